"""P/D from a DEP worker (`--data-parallel-size M --role prefill`): one handshake for every data-parallel rank.

Each DP rank is a whole engine (workers/engine/parallel/dp_engine.py) with its own pages, its own NIXL
connector and agent, and its own engine id; a request's transfer parameters come from the rank that
prefilled it (`remote_engine_id` is that rank's engine, `remote_block_ids` its pages), and the decode
side's READ notification reaches that rank's agent, which frees the pages on that rank. The DEP front
(workers/engine/parallel/dp_front.py), once every rank is up, asks each spawned rank for its endpoint
(`rank_endpoint`, the "transfer_endpoint" message: plain data, msgpack-safe for ranks on other nodes) and
hands them to rank 0's connector (`install`), whose `GetTransferMetadata` answer then lists them in
`dp_ranks` (workers/kv_transfer/handshake.py); the decode side picks the rank by engine id.

Under DEP attention runs at TP=1, so every rank's page geometry is rank 0's: the decode block must be a
whole multiple of the prefill block and the decode TP size any size (k3serve/common/pd_geometry.py, as for a
one-rank prefill worker).
"""

from __future__ import annotations


def rank_endpoint(engine, dp_rank: int) -> dict | None:
    """This DP rank's agent, page addresses and engine id as plain data (None without the P/D connector)."""
    from k3serve.workers.kv_transfer.grpc_pd import find_nixl
    from k3serve.workers.kv_transfer.handshake import RankEndpoint

    nixl = find_nixl(engine)
    if nixl is None or nixl.worker_half.agent is None:
        return None
    w = nixl.worker_half
    return RankEndpoint(0, w.agent.name, w._metadata, tuple(w.bases), nixl.ctx.engine_id, int(dp_rank)).to_plain()


def install(engine, endpoints: list) -> None:
    """Rank 0: the other DP ranks' endpoints (rank_endpoint's answers, rank order) into its handshake."""
    from k3serve.workers.kv_transfer.grpc_pd import find_nixl
    from k3serve.workers.kv_transfer.handshake import RankEndpoint

    nixl = find_nixl(engine)
    if nixl is None:
        return
    eps = [RankEndpoint.from_plain(d) for d in endpoints if d is not None]
    if len(eps) != len(endpoints):
        raise RuntimeError("a data-parallel rank has no transfer agent (its P/D connector did not start)")
    nixl.worker_half.dp_ranks = eps
