"""Conversions between worker.proto messages and plain Python data (no engine imports: the router uses it).

* `sampling_to_proto(kwargs)` / `sampling_kwargs_from_proto(msg)`: SamplingParams keyword arguments
  (as made by `k3serve.openai_api.protocol.sampling_kwargs`) ⇄ `SamplingParams` message; unset fields stay unset.
* `deltas_to_proto(deltas)` / `deltas_from_proto(msgs)`: `SeqDelta` ⇄ `SequenceDelta`.
* `load_to_dict(msg)`: `LoadResponse` → dict with `LLMEngine.stats()`'s keys (+ `kv_event_sequence`).
* `kv_event_to_proto(ev)` / `kv_event_from_proto(msg)`: a KV event (any object with KVEvent's fields)
  ⇄ `KvEvent`; `kv_batch_to_proto(sequence, snapshot, events, instance_id)`: one batch → one or more
  `KvEventBatch` messages of at most `max_events` events each (numbering as in worker.proto).
* `kv_transfer_params_to_proto(d)` / `kv_transfer_params_from_proto(msg)`: P/D transfer parameters as a
  plain dict (vLLM's `kv_transfer_params` names; `remote_block_ids` a list of per-group dicts
  {group_id, kind, block_ids}) ⇄ `KvTransferParams`; `kv_transfer_result_from_proto(msg)` → dict.
"""

from __future__ import annotations

import json

from k3serve.openai_api.deltas import SeqDelta
from k3serve.outputs import Logprob
from k3serve.proto import worker_pb2 as pb

_SCALARS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "max_tokens", "min_tokens", "ignore_eos", "logprobs", "skip_special_tokens",
            "spaces_between_special_tokens", "include_stop_str_in_output")


def sampling_to_proto(kwargs: dict) -> pb.SamplingParams:
    msg = pb.SamplingParams()
    for name in _SCALARS:
        value = kwargs.get(name)
        if value is not None:
            setattr(msg, name, value)
    msg.stop.extend(kwargs.get("stop") or [])
    msg.stop_token_ids.extend(kwargs.get("stop_token_ids") or [])
    for tid, bias in (kwargs.get("logit_bias") or {}).items():
        msg.logit_bias[int(tid)] = float(bias)
    so = kwargs.get("structured_outputs")
    if so is not None:
        so = so.to_dict() if hasattr(so, "to_dict") else so
        msg.structured_outputs = json.dumps(so, ensure_ascii=False, separators=(",", ":"))
    return msg


def sampling_kwargs_from_proto(msg: pb.SamplingParams) -> dict:
    """Keyword arguments for SamplingParams: only fields the sender set (SamplingParams' defaults fill
    the rest), except `max_tokens`, which is None (until the context is full) when unset."""
    kw: dict = {}
    for name in _SCALARS:
        if msg.HasField(name):
            kw[name] = getattr(msg, name)
    kw.setdefault("max_tokens", None)
    if msg.stop:
        kw["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kw["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.logit_bias:
        kw["logit_bias"] = {int(k): float(v) for k, v in msg.logit_bias.items()}
    if msg.HasField("structured_outputs"):
        try:
            kw["structured_outputs"] = json.loads(msg.structured_outputs)
        except ValueError as e:
            raise ValueError(f"structured_outputs: not valid JSON ({e})") from None
    return kw


def _logprobs_to_proto(token_ids: list[int], logprobs: list[dict]) -> list[pb.TokenLogprobs]:
    out = []
    for tid, entries in zip(token_ids, logprobs):
        tl = pb.TokenLogprobs(token_id=tid)
        ordered = sorted(entries.items(), key=lambda kv: (kv[0] != tid, kv[1].rank if kv[1].rank is not None else 0))
        for t, lp in ordered:
            e = tl.entries.add(token_id=t, logprob=float(lp.logprob))
            if lp.rank is not None:
                e.rank = int(lp.rank)
            if lp.decoded_token is not None:
                e.decoded_token = lp.decoded_token
        out.append(tl)
    return out


def deltas_to_proto(deltas: list[SeqDelta]) -> list[pb.SequenceDelta]:
    out = []
    for d in deltas:
        m = pb.SequenceDelta(index=d.index, token_ids=d.token_ids, text=d.text)
        if d.logprobs is not None:
            m.logprobs.extend(_logprobs_to_proto(d.token_ids, d.logprobs))
        if d.finish_reason is not None:
            m.finish_reason = d.finish_reason
        if isinstance(d.stop_reason, int) and not isinstance(d.stop_reason, bool):
            m.stop_token_id = d.stop_reason
        elif isinstance(d.stop_reason, str):
            m.stop_string = d.stop_reason
        out.append(m)
    return out


def deltas_from_proto(msgs, *, with_logprobs: bool) -> list[SeqDelta]:
    """`with_logprobs`: whether the request asked for logprobs (an empty list then still means "none so far")."""
    out = []
    for m in msgs:
        lps = None
        if with_logprobs:
            lps = [{e.token_id: Logprob(e.logprob, e.rank if e.HasField("rank") else None,
                                        e.decoded_token if e.HasField("decoded_token") else None)
                    for e in tl.entries} for tl in m.logprobs]
        which = m.WhichOneof("stop_reason")
        stop = getattr(m, which) if which else None
        out.append(SeqDelta(index=m.index, token_ids=list(m.token_ids), text=m.text, logprobs=lps,
                            finish_reason=m.finish_reason if m.HasField("finish_reason") else None,
                            stop_reason=stop))
    return out


def load_to_dict(msg: pb.LoadResponse) -> dict:
    return {k: getattr(msg, k) for k in ("running", "waiting", "free_pages", "total_pages", "kv_usage",
                                         "kda_slots_used", "kda_slots_total", "max_model_len", "model", "role",
                                         "kv_event_sequence")}


_KINDS = {"stored": pb.KvEvent.STORED, "removed": pb.KvEvent.REMOVED}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
MAX_EVENTS_PER_MESSAGE = 4096  # ~120 bytes each: far below gRPC's default 4 MiB message limit


def kv_event_to_proto(ev) -> pb.KvEvent:
    """`ev`: an object with KVEvent's fields (kind "stored"|"removed", block_hash bytes, parent_hash bytes|None,
    group_id, group_kind "mla"|"kda", num_tokens, block_size)."""
    try:
        kind = _KINDS[ev.kind]
    except KeyError:
        raise ValueError(f"KV event kind must be 'stored' or 'removed', got {ev.kind!r}") from None
    m = pb.KvEvent(kind=kind, block_hash=bytes(ev.block_hash), group_id=int(ev.group_id), group_kind=ev.group_kind,
                   num_tokens=int(ev.num_tokens), block_size=int(ev.block_size))
    if ev.parent_hash is not None:
        m.parent_hash = bytes(ev.parent_hash)
    return m


def kv_event_from_proto(msg: pb.KvEvent) -> dict:
    """A dict with KVEvent's field names (`parent_hash` None when unset)."""
    if msg.kind not in _KIND_NAMES:
        raise ValueError(f"KV event kind {msg.kind} is not STORED or REMOVED")
    return dict(kind=_KIND_NAMES[msg.kind], block_hash=bytes(msg.block_hash),
                parent_hash=bytes(msg.parent_hash) if msg.HasField("parent_hash") else None,
                group_id=msg.group_id, group_kind=msg.group_kind, num_tokens=msg.num_tokens, block_size=msg.block_size)


def kv_batch_to_proto(sequence: int, snapshot: bool, events: list, instance_id: str,
                      max_events: int = MAX_EVENTS_PER_MESSAGE) -> list[pb.KvEventBatch]:
    """Messages for one batch. A snapshot becomes chunks that all carry `sequence`, the last flagged
    `snapshot_complete` (an empty snapshot is one empty, complete message). A live batch whose events end at
    `sequence` becomes chunks numbered so that each chunk's `sequence` is the number of its own last event."""
    if max_events < 1:
        raise ValueError("max_events must be at least 1")
    protos = [kv_event_to_proto(e) for e in events]
    chunks = [protos[i:i + max_events] for i in range(0, len(protos), max_events)] or [[]]
    out = []
    first = sequence - len(protos) + 1
    done = 0
    for i, chunk in enumerate(chunks):
        done += len(chunk)
        seq = sequence if snapshot else first + done - 1
        out.append(pb.KvEventBatch(sequence=seq, snapshot=snapshot, snapshot_complete=snapshot and i == len(chunks) - 1,
                                   events=chunk, instance_id=instance_id))
    return out


_KVT_SCALARS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host",
                "remote_port", "remote_num_tokens", "remote_blocks_expiry_time", "tp_size", "block_size",
                "compatibility_hash", "remote_prompt_hash")


def kv_transfer_params_to_proto(d: dict) -> pb.KvTransferParams:
    """`d`: any subset of KvTransferParams' fields (unknown keys are an error, so a typo cannot pass silently)."""
    unknown = set(d) - set(_KVT_SCALARS) - {"remote_block_ids"}
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown field(s) {sorted(unknown)}")
    msg = pb.KvTransferParams()
    for name in _KVT_SCALARS:
        value = d.get(name)
        if value is not None:
            setattr(msg, name, value)
    for g in d.get("remote_block_ids") or []:
        msg.remote_block_ids.add(group_id=int(g["group_id"]), kind=str(g["kind"]),
                                 block_ids=[int(b) for b in g["block_ids"]])
    return msg


def kv_transfer_params_from_proto(msg: pb.KvTransferParams) -> dict:
    d = {name: getattr(msg, name) for name in _KVT_SCALARS}
    d["compatibility_hash"] = bytes(d["compatibility_hash"])
    d["remote_prompt_hash"] = bytes(d["remote_prompt_hash"])
    d["remote_block_ids"] = [dict(group_id=g.group_id, kind=g.kind, block_ids=list(g.block_ids))
                             for g in msg.remote_block_ids]
    return d


def kv_transfer_result_from_proto(msg: pb.KvTransferResult) -> dict:
    return dict(outcome=msg.outcome, reason=msg.reason, pulled_tokens=msg.pulled_tokens,
                local_cached_tokens=msg.local_cached_tokens, bytes=msg.bytes)
