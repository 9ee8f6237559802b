"""A subscriber's view of one worker's prefix cache, rebuilt from `SubscribeKvEvents` messages.

    index = KvEventIndex()
    for msg in stub.SubscribeKvEvents(pb.KvEventsRequest()):
        index.apply(msg)               # raises KvEventGap if a live batch does not follow the previous one
    index.entries                      # {(block_hash, group_id): event dict (kv_event_from_proto)}
    index.tokens()                     # {(block_hash, group_id): num_tokens}

No engine imports (the router uses it). The numbering rules are worker.proto's: snapshot messages reset
the index (the first one) and carry the sequence the snapshot reflects; each live batch must satisfy
`sequence - len(events) == last_sequence`. On KvEventGap (or a new `instance_id`) re-subscribe.
"""

from __future__ import annotations

from k3serve.proto.convert import kv_event_from_proto


class KvEventGap(RuntimeError):
    """A live batch did not continue the sequence (events were lost): re-subscribe."""


class KvEventIndex:
    def __init__(self):
        self.entries: dict[tuple[bytes, int], dict] = {}
        self.last_sequence: int | None = None  # None until a snapshot started
        self.instance_id: str | None = None
        self.snapshot_complete = False
        self.num_stored = 0  # live "stored" events applied
        self.num_removed = 0  # live "removed" events applied
        self.group_kinds_seen: set[str] = set()

    def apply(self, msg) -> None:
        """Apply one `KvEventBatch` message."""
        if msg.snapshot:
            if self.last_sequence is None or self.snapshot_complete or msg.instance_id != self.instance_id:
                self.entries.clear()
                self.snapshot_complete = False
            elif msg.sequence != self.last_sequence:
                raise KvEventGap(f"snapshot chunk with sequence {msg.sequence} inside snapshot {self.last_sequence}")
            self.instance_id = msg.instance_id
            self.last_sequence = msg.sequence
            for m in msg.events:
                ev = kv_event_from_proto(m)
                self.entries[(ev["block_hash"], ev["group_id"])] = ev
                self.group_kinds_seen.add(ev["group_kind"])
            self.snapshot_complete = msg.snapshot_complete
            return
        if self.last_sequence is None or not self.snapshot_complete:
            raise KvEventGap("live batch before a complete snapshot")
        if msg.instance_id != self.instance_id:
            raise KvEventGap(f"worker instance changed ({self.instance_id} -> {msg.instance_id})")
        if msg.sequence - len(msg.events) != self.last_sequence:
            raise KvEventGap(f"expected events after {self.last_sequence}, got {msg.sequence - len(msg.events) + 1}"
                             f"..{msg.sequence}")
        for m in msg.events:
            ev = kv_event_from_proto(m)
            key = (ev["block_hash"], ev["group_id"])
            self.group_kinds_seen.add(ev["group_kind"])
            if ev["kind"] == "stored":
                self.entries[key] = ev
                self.num_stored += 1
            else:
                self.entries.pop(key, None)
                self.num_removed += 1
        self.last_sequence = msg.sequence

    def tokens(self) -> dict[tuple[bytes, int], int]:
        return {k: e["num_tokens"] for k, e in self.entries.items()}
