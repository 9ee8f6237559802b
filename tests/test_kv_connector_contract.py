"""The KV connector contract (workers/engine/kv_connector/base.py) with a fake store connector that
loads asynchronously over several steps, saves at finish with a delayed free, and saves KDA boundary
snapshots through block holds — two engines share it like two workers share a store. Outputs equal
the reference (float64); every page and every hold comes back."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import pytest
from _engine_helpers import random_model_dir, reference_outputs

from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.api import EngineArgs
from k3serve.workers.engine.kv_connector.base import (
    NO_MATCH,
    ConnectorContext,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
)
from k3serve.workers.engine.kv_connector.factory import register_connector
from k3serve.workers.engine.llm_engine import LLMEngine
from k3serve.workers.engine.request import RequestStatus
from k3serve.workers.model.config import K3Config

DELAY = 3  # steps every async load, save and hold takes
_names = itertools.count()


@dataclass
class _Meta(KVConnectorMetadata):
    loads: list = field(default_factory=list)  # (request id, [(key, dst block)])
    saves: list = field(default_factory=list)  # (request id | None, [(key, src block)], hold block | None)


class FakeStoreScheduler(KVConnectorScheduler):
    name = "fake-store"
    stats_prefix = "fake_"

    def __init__(self, ctx: ConnectorContext, keys: set):
        super().__init__(ctx)
        self.keys = keys  # what the store holds (the worker half fills it a few steps after a save)
        self.B, self.u = ctx.layout.block_size, ctx.hash_unit
        self.mla = [g.group_id for g in ctx.layout.mla_groups]
        self.kda = [g.group_id for g in ctx.layout.kda_groups]
        self.meta = _Meta()
        self.lookups = 0
        self.loaded_tokens = 0
        self.finished_seen: list[str] = []

    def _h(self, req, p):
        i = p // self.u - 1
        return req.unit_hashes[i] if 0 <= i < len(req.unit_hashes) and p % self.u == 0 else None

    def _hit(self, req, start):
        best = 0
        p = (req.num_tokens - 1) // self.u * self.u
        while p > start:
            h = self._h(req, p)
            if h is not None and all(("kda", h, g) in self.keys for g in self.kda) and all(
                    ("mla", self._h(req, min((j + 1) * self.B, p)), g) in self.keys
                    for j in range(start // self.B, -(-p // self.B)) for g in self.mla):
                best = p
                break
            p -= self.u
        return best

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.lookups += 1
        hit = self._hit(request, num_computed_tokens)
        return MatchResult(hit - num_computed_tokens, is_async=True) if hit else NO_MATCH

    def update_state_after_alloc(self, request, spec):
        if not spec.num_external_tokens:
            return
        assert spec.is_async and spec.num_local_tokens % self.B == 0
        end = spec.num_local_tokens + spec.num_external_tokens
        jobs = []
        for g in self.mla:
            blocks = spec.load_block_ids(self.ctx.layout, g)
            assert len(blocks) == -(-end // self.B) - spec.num_local_tokens // self.B
            for i, b in enumerate(blocks):
                q = min((spec.num_local_tokens // self.B + i + 1) * self.B, end)
                jobs.append((("mla", self._h(request, q), g), b))
        for g in self.kda:
            jobs.append((("kda", self._h(request, end), g), spec.block_ids[g][0]))
        self.meta.loads.append((request.request_id, jobs))
        self.loaded_tokens += spec.num_external_tokens

    def on_boundary_snapshot(self, snap, request):
        self.hold_block(snap.block_id)
        self.meta.saves.append((None, [(("kda", snap.block_hash, snap.group_id), snap.block_id)], snap.block_id))

    def request_finished(self, request, block_ids):
        from k3serve.workers.engine.kv_connector.base import FinishResult

        self.finished_seen.append(request.request_id)
        if request.status == RequestStatus.FINISHED_ABORTED or not request.unit_hashes:
            return FinishResult()
        done = min(request.num_computed_tokens, request.num_tokens - 1)
        saves = []
        for g in self.mla:
            for j, b in enumerate(block_ids[g]):
                for q in range(j * self.B + self.u, min((j + 1) * self.B, done) + 1, self.u):
                    h = self._h(request, q)
                    if h is not None:
                        saves.append((("mla", h, g), b))
        self.meta.saves.append((request.request_id, saves, None))
        return FinishResult(delay_free=True, transfer_params={"saved_keys": len(saves)}, expiry_s=60.0)

    def build_connector_meta(self, step):
        m, self.meta = self.meta, _Meta()
        m.step = step
        return m

    def stats(self):
        return dict(lookups=self.lookups, loaded_tokens=self.loaded_tokens)


class FakeStoreWorker(KVConnectorWorker):
    def __init__(self, ctx, store: dict, keys: set):
        super().__init__(ctx)
        self.store, self.keys = store, keys
        self.pending: list = []  # [steps left, kind, payload]

    def start_load_kv(self, meta):
        for rid, jobs in meta.loads:
            self.pending.append([DELAY, "load", (rid, jobs)])
        for rid, saves, _hold in meta.saves:
            if rid is not None:  # finished request: its pages are pinned, copy them now
                self._copy_out(saves)
                self.pending.append([DELAY, "sent", rid])

    def save_kv(self, meta):
        for rid, saves, hold in meta.saves:
            if rid is None:  # a boundary snapshot: valid after this step's forward
                self._copy_out(saves)
                self.pending.append([DELAY, "release", hold])

    def _copy_out(self, saves):
        for key, b in saves:
            self.store[key] = [p[b].clone() for p in self.kv.pages]

    def get_finished(self):
        out = KVConnectorOutput()
        keep = []
        for job in self.pending:
            job[0] -= 1
            if job[0] > 0:
                keep.append(job)
                continue
            kind, payload = job[1], job[2]
            if kind == "load":
                rid, jobs = payload
                for key, dst in jobs:
                    for p, src in zip(self.kv.pages, self.store[key]):
                        p[dst] = src
                out.finished_recving.add(rid)
            elif kind == "sent":
                out.finished_sending.add(payload)
                for key in list(self.store):
                    self.keys.add(key)  # saves become visible once confirmed
            else:
                out.released_blocks.append(payload)
                for key in list(self.store):
                    self.keys.add(key)
        self.pending = keep
        out.stats = {"pending_jobs": len(keep)}
        return out


def _engine(model_dir, store, keys, **kw):
    """An engine with the fake store attached by name (EngineArgs.kv_connectors, the registry)."""
    name = f"fake-store-{next(_names)}"
    made = {}

    def factory(ctx: ConnectorContext) -> KVConnector:
        made["s"], made["w"] = FakeStoreScheduler(ctx, keys), FakeStoreWorker(ctx, store, keys)
        return KVConnector(made["s"], made["w"])

    register_connector(name, factory)
    args = EngineArgs(model=str(model_dir), dtype="float64", skip_tokenizer_init=True, max_model_len=160,
                      block_size=8, max_num_batched_tokens=24, max_num_seqs=4, enable_prefix_caching=True,
                      prefix_match_unit=4, kv_connectors=(name,), **kw)
    eng = LLMEngine(args)
    return eng, made["s"], made["w"]


def _run(eng, prompts, max_tokens=3):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{len(eng.parents)}-{i}-{random.random()}", p, sp.clone())
    outs = {}
    order = list(eng.parents)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[r] for r in order]


def _drain(eng):
    for _ in range(50):
        if not eng.scheduler.has_pending_connector_work():
            break
        eng.step()
    assert not eng.scheduler.has_pending_connector_work()
    assert eng.pool.num_free == eng.pool.num_usable
    assert all(b.ref_cnt == 0 for b in eng.pool.blocks)
    assert eng.kv_manager.reqs == {}


@pytest.mark.parametrize("seed", [3, 8])
def test_async_store_between_two_engines_equals_reference(tmp_path_factory, seed):
    d = random_model_dir(tmp_path_factory.getbasetemp(), seed)
    vocab = K3Config.from_pretrained(str(d)).vocab_size
    store, keys = {}, set()
    a, sa, wa = _engine(d, store, keys, prefix_cache_retention_interval=8)
    b, sb, wb = _engine(d, store, keys, prefix_cache_retention_interval=8)
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(rng.randint(30, 45))]
    first = [shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    outs_a = _run(a, first)
    assert all(o.kv_transfer_params and o.kv_transfer_params["saved_keys"] > 0 for o in outs_a)
    _drain(a)  # the delayed frees and the snapshot holds were confirmed by the worker half
    assert keys, "the fake store received nothing"
    second = [shared + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    outs_b = _run(b, second)
    st = b.stats()
    assert st["prefill_tokens_loaded"] > 0 and st["fake_loaded_tokens"] == st["prefill_tokens_loaded"]
    assert st["prefill_tokens_computed"] < sum(len(p) for p in second)
    want = reference_outputs(d, first + second, 3)
    assert [o.outputs[0].token_ids for o in outs_a + outs_b] == want
    _drain(b)


def test_abort_while_loading_holds_pages_until_the_load_reports(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 3)
    store, keys = {}, set()
    a, _sa, _wa = _engine(d, store, keys)
    b, _sb, wb = _engine(d, store, keys)
    prompt = list(range(1, 41))
    _run(a, [prompt])
    _drain(a)
    b.add_request("x", prompt[:36] + [7, 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    b.step()
    req = b.scheduler.loading.get("x")
    assert req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KV
    held = b.pool.num_usable - b.pool.num_free
    assert held > 0
    (final,) = b.abort_request("x")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert b.pool.num_usable - b.pool.num_free == held, "a transfer may still write these pages"
    _drain(b)  # the load reported, then the pages were freed


def test_delayed_free_expires_without_confirmation(tmp_path_factory):
    d = random_model_dir(tmp_path_factory.getbasetemp(), 3)
    store, keys = {}, set()
    a, sa, wa = _engine(d, store, keys)
    now = [0.0]
    a.scheduler.clock = lambda: now[0]
    wa.get_finished = lambda: KVConnectorOutput()  # the peer never confirms anything
    _run(a, [list(range(1, 30))])
    assert a.scheduler.delayed_free, "the finished request's pages were meant to stay pinned"
    a.step()
    assert a.scheduler.delayed_free
    now[0] = 61.0  # past expiry_s=60
    a.step()
    assert not a.scheduler.delayed_free
    assert a.pool.num_free == a.pool.num_usable - sum(a.scheduler.held_blocks.values())
