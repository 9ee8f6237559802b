"""The KV connector API: how something outside the device pool supplies or receives KV state.

Shape of vLLM v1's connector (design doc k3-model-and-cache.md §4.1), made hybrid-aware: every
call names cache groups (`CacheLayout.groups`, workers/engine/cache_layout.py), so MLA pages,
the request-level KDA state (conv window + recurrent state, one block per KDA group) and KDA
prefix snapshots are all expressible. docs/architecture.md ("KV connector API") is the guide;
this module is the contract.

A connector is two halves that share nothing but plain data:

* `KVConnectorScheduler` runs inside the scheduler (engine thread). It answers lookups, learns
  which pages were allocated for a load, builds one `KVConnectorMetadata` per step, decides at
  finish whether a request's pages stay pinned, and is told about evictions and retained KDA
  boundary snapshots.
* `KVConnectorWorker` runs next to the page tensors (the model runner). Per step it receives the
  metadata, starts loads and pre-step saves before the forward pass, waits for them (per layer or
  per step), runs post-step saves, and reports in a `KVConnectorOutput` which requests finished
  receiving or sending and which loads failed.

Token and block conventions (block size B, hash unit u, B % u == 0):

* A load always starts at a block boundary (`num_local_tokens % B == 0`, reconciled as in §4.2)
  and covers positions `num_local_tokens .. num_local_tokens + num_external_tokens - 1`.
* MLA groups: `block_ids[g]` is the request's whole block table; the loaded blocks are
  `block_ids[g][num_local_tokens // B : ceil((num_local + num_external) / B)]`, all freshly
  allocated (never shared with the prefix cache while loading).
* KDA groups: `block_ids[g] == [running_block]`; a load writes the state *at* position
  `num_local_tokens + num_external_tokens` into it (conv window + recurrent state).
* A connector hit must be *joint*: MLA pages for every loaded position and a KDA state for every
  KDA group at exactly the hit's end. A hit ends on a hash-unit multiple (or, for a P/D pull, at
  the prompt length the prefill side computed).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from k3serve.workers.engine.cache_layout import CacheLayout, KVCacheTensors
    from k3serve.workers.engine.request import Request

# Per cache group, indexed by group id (CacheLayout.groups order): MLA groups the block table,
# KDA groups a one-element list holding the request's running state block.
BlockIds = tuple[list[int], ...]


class ConnectorKind(enum.Enum):
    """TIER: a cache tier (host memory, the store) that may hold any prefix; several are ordered
    cheapest first. TRANSFER: a P/D connector that supplies a request's prompt only when the request
    carries `kv_transfer_params` from a peer; at most one per engine."""

    TIER = "tier"
    TRANSFER = "transfer"


# -- plain data the two halves exchange ---------------------------------------------------------

@dataclass(frozen=True)
class ConnectorContext:
    """What a connector is built with (both halves get the same one)."""

    layout: CacheLayout  # groups, block size, page geometry
    hash_unit: int  # prefix-hash granularity in tokens (divides layout.block_size)
    model_fingerprint: bytes  # k3serve.common.block_hash.model_fingerprint (part of every key)
    device: str  # "cpu" | "cuda[:i]"
    engine_id: str  # unique per engine process (P/D peers use it)
    enable_prefix_caching: bool
    args: Any = None  # the engine's EngineArgs: a connector's options are EngineArgs fields of their own
    extra_config: dict[str, Any] = field(default_factory=dict)  # options of a connector built by hand


@dataclass(frozen=True)
class MatchResult:
    """Answer to `get_num_new_matched_tokens`.

    num_tokens: tokens beyond `num_computed_tokens` the connector can supply (0: none);
        None: "ask again later" (a lookup still in flight) — the request stays waiting this step.
    is_async: True when the load completes over later steps: the request enters
        WAITING_FOR_REMOTE_KV until the worker half lists it in `finished_recving`.
    """

    num_tokens: int | None
    is_async: bool = False


NO_MATCH = MatchResult(0, False)
ASK_LATER = MatchResult(None, False)


@dataclass(frozen=True)
class LoadSpec:
    """One admitted load, given to `update_state_after_alloc` (and usually carried in metadata)."""

    request_id: str
    block_ids: BlockIds
    num_local_tokens: int  # block-aligned; tokens already in device pages (local prefix hit)
    num_external_tokens: int  # tokens the connector writes (0: the connector was not chosen)
    is_async: bool

    def load_block_ids(self, layout: CacheLayout, group_id: int) -> list[int]:
        """The blocks of `group_id` the load writes (MLA: covering the loaded tokens; KDA: the state block)."""
        g = layout.groups[group_id]
        if g.kind == "kda":
            return list(self.block_ids[group_id]) if self.num_external_tokens else []
        B = layout.block_size
        lo = self.num_local_tokens // B
        hi = -(-(self.num_local_tokens + self.num_external_tokens) // B)
        return list(self.block_ids[group_id][lo:hi])


@dataclass(frozen=True)
class CachedKey:
    """One prefix-cache key of a device block: (hash, group id), the prefix length it stands for
    and its parent hash (what k3serve.kv_events.types.KVEvent carries)."""

    block_hash: bytes
    group_id: int
    num_tokens: int
    parent_hash: bytes | None


@dataclass(frozen=True)
class EvictedBlock:
    """A cached device block about to be reused (keys dropped). Its bytes are still intact until
    the next forward pass: a connector that wants them (copy-on-evict) schedules a pre-step save
    of `block_id` in this step's metadata; the runner runs pre-step saves before any page copy or
    forward pass of the step."""

    block_id: int
    group_id: int
    kind: str  # "mla" | "kda"
    keys: tuple[CachedKey, ...]


@dataclass(frozen=True)
class BoundarySnapshot:
    """A KDA prefix snapshot retained at an exact boundary (request, group, block, boundary).

    Handed to `on_boundary_snapshot` in the step whose forward pass computes it; its bytes are
    valid after that step's forward (save it post-step). `block_hash` is the key's hash: the chained
    unit hash of the first `boundary` tokens; `parent_hash` the one a unit earlier."""

    request_id: str
    group_id: int
    block_id: int
    boundary: int
    block_hash: bytes
    parent_hash: bytes | None


@dataclass
class KVConnectorMetadata:
    """Per-step message from the scheduler half to the worker half. Connectors subclass it (or
    put plain data in `data`); it must stay picklable (multi-rank engines ship it to every rank)."""

    step: int = 0
    data: Any = None


@dataclass
class KVConnectorOutput:
    """Per-step report from the worker half back to the scheduler half (and the scheduler).

    finished_recving: async loads now complete (requests leave WAITING_FOR_REMOTE_KV).
    finished_sending: requests whose delayed free may now happen (their pages are released).
    failed_recving: loads that failed: those requests recompute from their local hit (never lost).
    released_blocks: blocks the scheduler half asked to hold (`hold_block`) whose save is done
        (one entry per hold).
    stats: the worker half's counters (plain numbers, cumulative, keys without the prefix); they
        appear in `LLMEngine.stats()` under the connector's `stats_prefix`, next to the scheduler
        half's `stats()`.
    """

    finished_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    released_blocks: list[int] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    parts: list[KVConnectorOutput] = field(default_factory=list)  # per child, from a composite


@dataclass(frozen=True)
class FinishResult:
    """Answer to `request_finished`.

    delay_free: keep the request's pages (every group) pinned until the worker half reports the
        request in `finished_sending`, or until `expiry_s` seconds pass (then they are freed anyway).
    transfer_params: returned to the caller with the request's final output
        (`RequestOutput.kv_transfer_params`): what a P/D peer needs to pull.
    """

    delay_free: bool = False
    transfer_params: dict[str, Any] | None = None
    expiry_s: float = 30.0


# -- the two halves ---------------------------------------------------------------------------

class KVConnectorScheduler:
    """Scheduler half. Default methods do nothing, so a connector overrides only what it uses.

    `self.hold_block(block_id)` / the scheduler's holds: a connector may ask the scheduler to keep
    a device block referenced beyond this step (e.g. a boundary snapshot it saves asynchronously);
    the hold ends when the worker half reports the id in `released_blocks`.
    """

    kind: ConnectorKind = ConnectorKind.TIER
    name: str = "connector"
    stats_prefix: str = ""  # e.g. "kv_offload_" -> LLMEngine.stats()["kv_offload_hit_tokens"]
    wants_blocks_stored: bool = False  # True: on_blocks_stored is called (costs a call per keyed page)

    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx
        self._hold_requests: list[int] = []
        # read-only view of the device prefix cache, {(hash, group id): block with .block_id,
        # .key_tokens}, bound by the engine: a tier may combine device-resident pages with its own
        # (e.g. device MLA pages + a host KDA snapshot) — copy from them in the step's loads, which
        # read every source before writing any destination
        self.device_cache: Mapping | None = None

    # lookup (must be side-effect free: it may be called again for the same request next step)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> MatchResult:
        """Tokens past `num_computed_tokens` (the block-aligned local hit) this connector can load."""
        return NO_MATCH

    def update_state_after_alloc(self, request: Request, spec: LoadSpec) -> None:
        """Pages are allocated. A load happens iff `spec.num_external_tokens > 0` (the connector was
        chosen); a connector not chosen gets `num_external_tokens == 0` and must forget its lookup."""

    def get_loaded_group_ids(self) -> tuple[int, ...] | None:
        """Group ids this connector's loads write (None: all groups). A P/D pull writes all."""
        return None

    # per step
    def build_connector_meta(self, step: int) -> KVConnectorMetadata:
        """This step's instructions for the worker half (loads, saves); resets per-step state."""
        return KVConnectorMetadata(step=step)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker half's report for the step just run."""

    # cache events
    def on_block_evicted(self, block: EvictedBlock) -> None:
        """A cached device block is being reused (its keys are gone from the device cache)."""

    def on_boundary_snapshot(self, snap: BoundarySnapshot, request: Request) -> None:
        """A KDA snapshot is retained at an exact boundary this step."""

    def on_blocks_stored(self, request: Request, keys: list[tuple[int, CachedKey]]) -> None:
        """MLA pages (block id, key) keyed in the prefix cache this step (only when
        `wants_blocks_stored`); KDA snapshots come through on_boundary_snapshot. A store connector
        that saves on compute uses this instead of on_block_evicted."""

    # finish
    def request_finished(self, request: Request, block_ids: BlockIds) -> FinishResult:
        """The request finished (any reason, abort included). Its pages are about to be freed."""
        return FinishResult()

    def hold_block(self, block_id: int) -> None:
        """Ask the scheduler to keep `block_id` referenced until the worker reports it released."""
        self._hold_requests.append(block_id)

    def take_hold_requests(self) -> list[int]:
        out, self._hold_requests = self._hold_requests, []
        return out

    def stats(self) -> dict[str, float]:
        """Cumulative counters this half owns (keys without the prefix)."""
        return {}


class KVConnectorWorker:
    """Worker half: runs next to the page tensors, on the runner's thread."""

    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx
        self.kv: KVCacheTensors | None = None

    def register_kv_caches(self, kv: KVCacheTensors) -> None:
        """The device page tensors (`kv.pages[j]`, uint8 [num_blocks, page_bytes]) and typed views."""
        self.kv = kv

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Before the step's page copies and forward pass: run pre-step saves (evicted pages about to
        be overwritten) and start this step's loads."""

    def wait_for_layer_load(self, layer_id: int) -> None:
        """Block until every load of this step has written layer `layer_id` (default: no-op; the
        runner calls `wait_for_load` once before the forward pass)."""

    def wait_for_load(self) -> None:
        """Block until every synchronous load started this step is in the pages."""

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """After the forward pass: start post-step saves (boundary snapshots, finished requests)."""

    def get_finished(self) -> KVConnectorOutput:
        """What completed since the last call (polled once per step, after the forward pass)."""
        return KVConnectorOutput()

    def shutdown(self) -> None:
        """Release host buffers, agents, clients."""


@dataclass
class KVConnector:
    """A connector as the engine holds it: both halves, built from one `ConnectorContext`."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker

    @property
    def name(self) -> str:
        return self.scheduler.name

    @property
    def kind(self) -> ConnectorKind:
        return self.scheduler.kind
