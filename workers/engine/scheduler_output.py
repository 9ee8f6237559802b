"""SchedulerOutput: one step's plan for the model runner, as deltas (plain data).

A request's block tables and KDA state slots are sent once, in `NewRequestData`, when it is first
scheduled (again after a preemption or a failed load); afterwards each step's `ScheduledChunk`
carries only the blocks appended this step. The runner keeps the tables
(workers/engine/model_runner.py, `BlockTables`) and drops a request's row when its id appears in
`finished_req_ids` or `preempted` (applied before `new_requests`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NewRequestData:
    request_id: str
    block_ids: list[list[int]]  # per MLA group: the whole block table so far
    kda_slots: list[int]  # per KDA group: the running state block (fixed for the request's life)


@dataclass(slots=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # the tokens to compute (positions start .. start+len-1)
    start: int  # tokens already computed (> 0: the KDA state and the pages hold a prefix)
    sample: bool  # the chunk reaches the last known token: sample a new one after it
    new_block_ids: list[list[int]]  # per MLA group: blocks appended this step ([] when none)
    checkpoints: list[tuple[int, list[int]]]  # (tokens into this chunk, snapshot block per KDA group)


@dataclass
class SchedulerOutput:
    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # left the runner since the last step
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    kv_connector_metadata: Any = None  # workers/engine/kv_connector/base.py KVConnectorMetadata
    # speculative decoding (workers/engine/spec/): the drafts in a request's chunk (its chunk is the last
    # sampled token followed by them, `sample` at every position) and its rollback scheme's extra KDA
    # blocks per KDA group (workers/engine/spec/rollback.py; [] per group for schemes without any)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_slots: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
