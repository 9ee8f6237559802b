"""Multi-rank workers on CPU ranks (gloo): tensor parallelism and expert parallelism for LatentMoE.

    group.py     RankGroup: one gloo process group over loopback, the collectives the model issues (logged)
    shard.py     which layouts can shard a model (check_layout), each rank's config and weight shard, ExpertMap
    layers.py    ParallelK3ForwardModel: the engine's model with vocab-parallel embedding / LM head,
                 head-sharded KDA and MLA, column/row-parallel MLPs, TP-sliced or expert-parallel MoE
    launcher.py  the process model: rank 0 runs the scheduler and the sampler, ranks 1..N-1 are spawned
                 processes that receive each step's SchedulerOutput over a pipe and run the model runner

The single-rank engine does not import this package (workers/engine/llm_engine.py imports it only when
tensor_parallel_size > 1).
"""
