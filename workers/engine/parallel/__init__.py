"""Multi-rank workers on CPU ranks (gloo): tensor parallelism and expert parallelism for LatentMoE.

    group.py     RankGroup: one gloo process group over loopback, the collectives the model issues (logged)
    shard.py     which layouts can shard a model (check_layout), each rank's config and weight shard, ExpertMap
    layers.py    ParallelK3ForwardModel: the engine's model with vocab-parallel embedding / LM head,
                 head-sharded KDA and MLA, column/row-parallel MLPs, TP-sliced or expert-parallel MoE
    moe_a2a.py   expert-parallel MoE by all-to-all: dispatch each rank's own tokens to the ranks holding
                 their experts (ExpertMap), combine the weighted results back (ragged counts)
    seq_parallel.py  SequenceParallelK3ForwardModel: TEP with sequence parallelism (token-sharded residual
                 stream: reduce-scatter after o_proj, MoE by all-to-all, all-gather before QKV)
    launcher.py  the process model: rank 0 runs the scheduler and the sampler, ranks 1..N-1 are spawned
                 processes that receive each step's SchedulerOutput over a pipe and run the model runner
    nodes.py     a group spanning nodes: where each rank lives (NodeLayout), the leader's TCP link to the
                 other nodes' ranks (RemoteRank / LeaderLink, heartbeats), the pod contract's placement env
    node_process.py  what a non-leader node runs (`k3serve worker --node-rank K`): its ranks and /health
    ray_launcher.py  ranks 1..N-1 as Ray actors in a placement group (`distributed_executor_backend="ray"`)
    dp_model.py  DEPForwardModel: a data-parallel rank's forward (attention TP=1, routed experts by all-to-all)
    dp_engine.py the DEP group: check_dp_layout, each rank a whole engine (DEPModelRunner: one forward pass
                 per step, a dummy one when idle), the spawned ranks' message loop
    dp_front.py  DPEngine: the group as one engine (spreading by load and prefix hit, KV-event merging)
    dp_wire.py   what a DEP rank on another node answers the leader: msgpack with explicit encoders, no pickle

The single-rank engine does not import this package (workers/engine/llm_engine.py imports it only when
tensor_parallel_size or data_parallel_size > 1).
"""
