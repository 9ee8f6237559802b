"""The P/D half of the worker's gRPC service (contract: docs/serving.md "P/D: prefill, then decode").

    nixl = find_nixl(llm_engine)                  # the engine's NIXL connector halves, or None
    plan = pd_plan(request, nixl, role)           # what Generate does with request.kv_transfer_params
    transfer_metadata(nixl, request)              # GetTransferMetadata's answer (raises IncompatiblePeer)

`pd_plan` returns a `PDPlan`: `mode` "plain" (no P/D), "prefill" (compute the prompt one token short,
answer transfer parameters) or "decode" (the engine pulls through the connector); or raises
`PDRefused` (FAILED_PRECONDITION: a misconfigured pair, never a transfer fault).
"""

from __future__ import annotations

from dataclasses import dataclass

from k3serve.workers.kv_transfer.compat import IncompatiblePeer, compatibility_hash


class PDRefused(ValueError):
    """The request's P/D parameters cannot be served by this worker (FAILED_PRECONDITION)."""


@dataclass
class PDPlan:
    mode: str  # plain | prefill | decode
    params: dict | None = None  # for the engine's add_request(kv_transfer_params=...)
    note: str = ""  # decode requests served without a pull: the reason (KvTransferResult.reason)


def find_nixl(engine):
    """The NixlScheduler of an LLMEngine's connector (composite or not), or None."""
    from k3serve.workers.kv_transfer.connector import NixlScheduler

    conn = getattr(engine, "connector", None)
    if conn is None:
        return None
    sched = conn.scheduler
    if isinstance(sched, NixlScheduler):
        return sched
    t = getattr(sched, "transfer", None)
    return t if isinstance(t, NixlScheduler) else None


def _describe_remote_mismatch(nixl, params: dict) -> str:
    """Ask the prefill worker to compare factors (its FAILED_PRECONDITION names the difference)."""
    from k3serve.workers.kv_transfer.handshake import PeerUnreachable, fetch_metadata

    addr = f"{params.get('remote_host', '')}:{int(params.get('remote_port', 0))}"
    try:
        fetch_metadata(addr, nixl.factors)
    except IncompatiblePeer as e:
        return str(e)
    except PeerUnreachable:
        pass
    return ("incompatible P/D peer: the prefill worker's compatibility hash differs from ours "
            "(another model, dtype or cache layout)")


def pd_plan(params: dict | None, nixl, role: str, n: int) -> PDPlan:
    if not params or not (params.get("do_remote_decode") or params.get("do_remote_prefill")):
        return PDPlan("plain")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise PDRefused("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
    if nixl is None:
        raise PDRefused(f"kv_transfer_params: this worker runs --role {role}, without a transfer connector "
                        "(start P/D workers with --role prefill or --role decode)")
    if params.get("do_remote_decode"):  # the prompt only: the sampling parameters (n too) are the decode hop's
        return PDPlan("prefill", {"do_remote_decode": True})
    if bytes(params.get("compatibility_hash", b"")) != nixl.hash:
        raise PDRefused(_describe_remote_mismatch(nixl, params))
    if int(params.get("tp_size", 1)) < 1 or int(params.get("block_size", 0)) < 1:
        raise PDRefused("kv_transfer_params: tp_size and block_size must be positive (copy the prefill "
                        "worker's answer unchanged)")
    from k3serve.common.pd_geometry import PDGeometryError

    try:
        nixl.check_remote_geometry(int(params["tp_size"]), int(params["block_size"]))
    except PDGeometryError as e:
        raise PDRefused(f"kv_transfer_params: {e}") from None
    if n != 1:  # n sequences would each pull (and each release) the same pinned pages
        return PDPlan("decode", None, "n_greater_than_1")
    d = dict(params)
    d["do_remote_prefill"] = True
    return PDPlan("decode", d)


def transfer_metadata(nixl, pb, request):
    if nixl is None:
        raise PDRefused("this worker has no transfer connector (--role both)")
    return nixl.worker_half.transfer_metadata(pb, request)


def compat_hash_of(nixl) -> bytes:
    return compatibility_hash(nixl.factors) if nixl is not None else b""


def prefill_sampling():
    """The prefill hop's sampling: one greedy token the engine samples and nobody uses."""
    from k3serve.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def transfer_params_out(nixl, params: dict, host: str, port: int) -> dict:
    """The engine's transfer parameters plus this worker's gRPC address (the decode side's handshake)."""
    d = dict(params)
    d.update(remote_host=host, remote_port=int(port))
    return d


def empty_transfer_params(nixl, request_id: str, host: str, port: int) -> dict:
    """A one-token prompt: nothing to compute one token short, nothing to pull."""
    import time

    return dict(remote_engine_id=nixl.ctx.engine_id, remote_request_id=request_id, remote_block_ids=[],
                remote_prompt_hash=b"",
                remote_num_tokens=0, remote_blocks_expiry_time=time.time() + nixl.expiry_s,
                tp_size=nixl.tp_size, block_size=nixl.ctx.layout.block_size, compatibility_hash=nixl.hash,
                remote_host=host, remote_port=int(port))


def decode_result(nixl, plan: PDPlan, request_id: str) -> dict | None:
    """The KvTransferResult of a decode request (None for plain requests)."""
    if plan.mode != "decode":
        return None
    if plan.params is None:
        return dict(outcome="recomputed", reason=plan.note, pulled_tokens=0, local_cached_tokens=0, bytes=0)
    got = nixl.ledger.pop(request_id)
    return got or dict(outcome="recomputed", reason="not_admitted", pulled_tokens=0, local_cached_tokens=0,
                       bytes=0)
