"""What a DEP rank on another node answers its leader: msgpack with explicit encoders, never pickle.

A data-parallel rank on a non-leader node (workers/engine/parallel/node_process.py) answers the leader's
messages (workers/engine/parallel/dp_engine.py, dp_rank_main) over its TCP link (nodes.py). The leader
must not unpickle what the network sends it, so every answer is msgpack of plain data (None, bool, int,
float, str, bytes, lists, dicts) plus exactly these types, each an ext type holding its fields in order:

    1 RequestOutput (k3serve/outputs.py)   2 CompletionOutput   3 Logprob
    4 KVEvent (k3serve/kv_events/types.py) 5 Outcome (workers/kv_transfer/connector.py: P/D outcomes)

Tuples arrive as lists (the leader unpacks them positionally). Anything else is a TypeError on the rank
(a bug, not data), and a frame the leader cannot read is a ValueError there, so a corrupt or foreign
frame never becomes an object.
"""

from __future__ import annotations

import dataclasses

import msgpack

from k3serve.kv_events.types import KVEvent
from k3serve.outputs import CompletionOutput, Logprob, RequestOutput


def _outcome_cls():
    from k3serve.workers.kv_transfer.connector import Outcome

    return Outcome


_STATIC = {1: RequestOutput, 2: CompletionOutput, 3: Logprob, 4: KVEvent}


def _types() -> dict[int, type]:
    return {**_STATIC, 5: _outcome_cls()}


def _default(obj):
    for code, cls in _types().items():
        if type(obj) is cls:
            fields = [getattr(obj, f.name) for f in dataclasses.fields(cls)]
            return msgpack.ExtType(code, msgpack.packb(fields, default=_default, use_bin_type=True))
    raise TypeError(f"dp_wire: cannot send {type(obj).__name__!r} to the leader (not plain data)")


def encode(msg) -> bytes:
    """A rank's answer (a tuple such as ("ok", value, transfers)) as one frame."""
    return msgpack.packb(list(msg), default=_default, use_bin_type=True)


def _ext_hook(code: int, data: bytes):
    cls = _types().get(code)
    if cls is None:
        raise ValueError(f"dp_wire: unknown type code {code}")
    fields = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(fields, list) or len(fields) != len(names):
        raise ValueError(f"dp_wire: a {cls.__name__} needs {len(names)} fields")
    return cls(*fields)


def decode(frame: bytes) -> tuple:
    """The leader's read of one frame: (status, value, ...) with the types above rebuilt."""
    try:
        msg = msgpack.unpackb(frame, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - ours (a bad type code or field count) or msgpack's (truncated, ...)
        text = str(e)
        raise ValueError(text if text.startswith("dp_wire:") else
                         f"dp_wire: unreadable frame ({type(e).__name__}: {text})") from None
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
        raise ValueError("dp_wire: a frame must be a list starting with its status")
    return tuple(msg)
