"""One engine sequence (a request with n > 1 becomes n sequences that share a parent)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from k3serve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # pages allocated, a connector's async load in flight
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """A sequence under the scheduler. `all_token_ids` = prompt + output so far."""

    request_id: str  # unique per sequence: "<parent>" or "<parent>#<i>" when n > 1
    parent_id: str
    index: int  # position among the parent's n completions
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not yet admitted)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # prefix caching: chained unit hashes of all_token_ids (full units only)
    unit_hashes: list[bytes] = field(default_factory=list)
    # positions (token counts) whose KDA state this request retains in the prefix cache
    retained_boundaries: set[int] = field(default_factory=set)
    shared_prefix_boundary: int = 0  # Marconi junction found at admission (0: none)
    # length the current prefill must reach before sampling resumes (prompt, or prompt+output
    # after a preemption)
    prefill_end: int = 0
    # KV connectors (workers/engine/kv_connector/base.py)
    kv_transfer_params: dict | None = None  # given with the request (e.g. from a P/D prefill peer)
    kv_transfer_params_out: dict | None = None  # returned by the connector at finish
    num_external_tokens: int = 0  # tokens a connector loaded at the last admission
    kv_load_failed: bool = False  # a connector load failed: recompute, ask no connector again
    # speculative decoding: the proposer's drafts for the next step (dropped on preemption)
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.prefill_end = len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
