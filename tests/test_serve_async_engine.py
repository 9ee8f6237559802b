"""AsyncEngine (one engine thread, asyncio streams, abort, failure), EngineMetrics and DeltaTracker."""

import asyncio
import itertools
import threading

import _serve_fakes as fakes  # tests/ is on sys.path (conftest)
import pytest
from prometheus_client import CollectorRegistry

from k3serve.openai_api.deltas import DeltaTracker
from k3serve.outputs import CompletionOutput, Logprob, RequestOutput
from k3serve.sampling_params import SamplingParams
from k3serve.workers.async_engine import (
    AsyncEngine,
    DuplicateRequestError,
    EngineDeadError,
    RequestFailedError,
    new_request_id,
)
from k3serve.workers.metrics import EngineMetrics

M = "m"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return fakes.make_tokenizer(tmp_path_factory.mktemp("tok"))


class ThreadRecorder(fakes.FakeEngine):
    """Records the thread of every engine call."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.threads = set()

    def step(self):
        self.threads.add(threading.get_ident())
        return super().step()

    def add_request(self, *a, **kw):
        self.threads.add(threading.get_ident())
        return super().add_request(*a, **kw)


def make(engine):
    registry = CollectorRegistry()
    aeng = AsyncEngine(engine, model_name=M, metrics=EngineMetrics(registry, M), idle_wait_s=0.02)
    aeng.start()
    return aeng, registry


def sample(registry, name, **labels):
    return registry.get_sample_value(name, {"model_name": M, **labels})


def run(coro, timeout=20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_generate_streams_cumulative_outputs_on_one_thread(tok):
    engine = ThreadRecorder(tok, script=lambda p, params, i: tok.encode("abc def"))
    aeng, registry = make(engine)
    try:
        async def go():
            return [o async for o in aeng.generate(new_request_id(), [1, 2, 3], SamplingParams(max_tokens=50))]

        outs = run(go())
        expected = tok.encode("abc def") + [tok.eos_token_id]
        assert [len(o.outputs[0].token_ids) for o in outs] == list(range(1, len(expected) + 1))
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
        assert outs[-1].outputs[0].token_ids == expected
        assert outs[-1].outputs[0].text.startswith("abc def")
        assert len(engine.threads) == 1 and threading.get_ident() not in engine.threads
        # metrics from the outputs
        assert sample(registry, "vllm:prompt_tokens_total") == 3
        assert sample(registry, "vllm:generation_tokens_total") == len(expected)
        assert sample(registry, "vllm:request_success_total", finished_reason="stop") == 1
        assert sample(registry, "vllm:time_to_first_token_seconds_count") == 1
        assert sample(registry, "vllm:inter_token_latency_seconds_count") == len(expected) - 1
        assert sample(registry, "vllm:e2e_request_latency_seconds_count") == 1
        assert sample(registry, "vllm:request_queue_time_seconds_count") == 1
        assert sample(registry, "k3serve_engine_step_seconds_count") >= len(expected)
        assert sample(registry, "k3serve_kda_state_slots_total") == 50
        # gauges settle right after the engine's last step (asynchronously to the stream's consumer)
        for _ in range(100):
            if sample(registry, "vllm:num_requests_running") == 0:
                break
            threading.Event().wait(0.02)
        assert sample(registry, "vllm:num_requests_running") == 0
        assert aeng.stats()["total_pages"] == 100
    finally:
        aeng.shutdown()


def test_rejections_and_duplicates(tok):
    engine = fakes.FakeEngine(tok, max_model_len=8, script=lambda p, params, i: itertools.cycle([5]), step_delay=0.01)
    aeng, _ = make(engine)
    try:
        async def go():
            with pytest.raises(ValueError, match="max_model_len"):
                await aeng.add_request("long", list(range(8)), SamplingParams())
            assert aeng.num_in_flight() == 0
            s = await aeng.add_request("dup", [1], SamplingParams(max_tokens=None, ignore_eos=True))
            with pytest.raises(DuplicateRequestError):
                await aeng.add_request("dup", [1], SamplingParams())
            s.abort()
            outs = [o async for o in s]
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
            # the id is free again once finished
            s2 = await aeng.add_request("dup", [1], SamplingParams(max_tokens=2))
            assert [o async for o in s2][-1].outputs[0].finish_reason == "length"

        run(go())
        assert engine.aborted == ["dup"]
    finally:
        aeng.shutdown()


def test_leaving_the_stream_or_cancelling_aborts(tok):
    engine = fakes.FakeEngine(tok, script=lambda p, params, i: itertools.cycle([7]), step_delay=0.005)
    aeng, registry = make(engine)
    try:
        async def early_break():
            async for out in aeng.generate("brk", [1], SamplingParams(max_tokens=None, ignore_eos=True)):
                if len(out.outputs[0].token_ids) >= 3:
                    break

        async def cancelled():
            async def consume():
                async for _ in aeng.generate("cnl", [1], SamplingParams(max_tokens=None, ignore_eos=True)):
                    pass

            task = asyncio.ensure_future(consume())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        run(early_break())
        run(cancelled())
        for _ in range(200):
            if set(engine.aborted) == {"brk", "cnl"} and aeng.num_in_flight() == 0:
                break
            threading.Event().wait(0.02)
        assert set(engine.aborted) == {"brk", "cnl"}
        assert aeng.num_in_flight() == 0 and not engine.reqs
        assert sample(registry, "vllm:request_success_total", finished_reason="abort") == 2
    finally:
        aeng.shutdown()


def test_abort_before_first_output_ends_stream_with_all_sequences(tok):
    engine = fakes.FakeEngine(tok, script=lambda p, params, i: itertools.cycle([7]), step_delay=0.2)
    aeng, _ = make(engine)
    try:
        async def go():
            s = await aeng.add_request("early", [1, 2], SamplingParams(n=2, max_tokens=None, ignore_eos=True))
            assert aeng.abort("early") and not aeng.abort("unknown")
            return [o async for o in s]

        outs = run(go())
        assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["abort", "abort"]
    finally:
        aeng.shutdown()


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(tok):
    """A step that raises (here: while a request with top_k=13 runs) fails the requests of that step with
    RequestFailedError and aborts them in the engine; the engine stays healthy and serves the next one."""
    engine = fakes.FakeEngine(tok, script=lambda p, params, i: itertools.cycle([7]),
                              fail_if=lambda params: any(p.top_k == 13 for p in params))
    fatal = []
    aeng = AsyncEngine(engine, model_name=M, idle_wait_s=0.02, on_fatal=lambda: fatal.append(1))
    aeng.start()
    try:
        async def go():
            with pytest.raises(RequestFailedError, match="simulated poisoned request"):
                async for _ in aeng.generate("bad", [1], SamplingParams(max_tokens=5, top_k=13)):
                    pass
            for i in range(5):  # containment never runs out while good steps happen in between
                with pytest.raises(RequestFailedError):
                    async for _ in aeng.generate(f"bad{i}", [1], SamplingParams(max_tokens=5, top_k=13)):
                        pass
                outs = [o async for o in aeng.generate(f"good{i}", [1], SamplingParams(max_tokens=3, ignore_eos=True))]
                assert outs[-1].finished and outs[-1].outputs[0].token_ids == [7, 7, 7]

        run(go())
        assert aeng.is_healthy() and aeng.error is None and not fatal
        assert aeng.num_contained_failures == 6 and "bad" in engine.aborted and not engine.reqs
    finally:
        aeng.shutdown()


def test_an_engine_that_keeps_failing_is_fatal(tok):
    """Every step raising: after max_consecutive_step_failures contained failures the engine thread ends,
    streams and later calls get EngineDeadError, /health turns false and on_fatal runs once."""
    engine = fakes.FakeEngine(tok, script=lambda p, params, i: itertools.cycle([7]), fail_on_step=1)
    fatal = []
    aeng = AsyncEngine(engine, model_name=M, idle_wait_s=0.02, on_fatal=lambda: fatal.append(1),
                       max_consecutive_step_failures=2)
    aeng.start()
    try:
        async def go():
            for i in range(2):
                with pytest.raises(RequestFailedError, match="simulated engine failure"):
                    async for _ in aeng.generate(f"x{i}", [1], SamplingParams(max_tokens=100, ignore_eos=True)):
                        pass
            with pytest.raises(EngineDeadError, match="simulated engine failure"):
                async for _ in aeng.generate("x2", [1], SamplingParams(max_tokens=100, ignore_eos=True)):
                    pass
            with pytest.raises(EngineDeadError):
                await aeng.add_request("y", [1], SamplingParams())

        run(go())
        assert not aeng.is_healthy() and isinstance(aeng.error, RuntimeError) and fatal == [1]
    finally:
        aeng.shutdown()


def test_shutdown_releases_waiters(tok):
    engine = fakes.FakeEngine(tok, script=lambda p, params, i: itertools.cycle([7]), step_delay=0.01)
    aeng, _ = make(engine)

    async def go():
        s = await aeng.add_request("z", [1], SamplingParams(max_tokens=None, ignore_eos=True))
        await asyncio.sleep(0.05)
        threading.Thread(target=aeng.shutdown).start()
        with pytest.raises(EngineDeadError):
            async for _ in s:
                pass

    run(go())
    assert not aeng.is_healthy()


def test_metrics_follow_cumulative_engine_stats():
    registry = CollectorRegistry()
    m = EngineMetrics(registry, M)
    m.on_stats(dict(running=2, waiting=1, kv_usage=0.5, free_pages=7, kda_slots_used=3, kda_slots_total=9,
                    prefix_cache_queries=10, prefix_cache_hits=4, prefix_cache_mla_hits=4, prefix_cache_kda_hits=2,
                    num_preemptions=1))
    m.on_stats(dict(prefix_cache_queries=25, prefix_cache_hits=4, prefix_cache_kda_hits=5, num_preemptions=1))
    assert sample(registry, "vllm:prefix_cache_queries_total") == 25
    assert sample(registry, "vllm:prefix_cache_hits_total") == 4
    assert sample(registry, "k3serve_prefix_cache_group_hits_tokens_total", group="kda") == 5
    assert sample(registry, "k3serve_prefix_cache_group_queries_tokens_total", group="mla") == 25
    assert sample(registry, "vllm:num_preemptions_total") == 1
    assert sample(registry, "vllm:num_requests_running") == 2 and sample(registry, "vllm:kv_cache_usage_perc") == 0.5
    assert sample(registry, "k3serve_kv_pages_free") == 7 and sample(registry, "k3serve_kda_state_slots_used") == 3
    # queue time from the engine's own timestamps
    m.on_arrival("r", 5, 100.0)
    out = RequestOutput("r", None, [1] * 5, [CompletionOutput(0, "a", [9])], False,
                        metrics={"arrival_time": 50.0, "first_scheduled_time": 50.25})
    m.on_step([out], 100.5, 101.0)
    assert sample(registry, "vllm:request_queue_time_seconds_sum") == 0.25
    assert sample(registry, "vllm:time_to_first_token_seconds_sum") == 1.0


def test_delta_tracker():
    lp = [{9: Logprob(-0.1, 1)}, {8: Logprob(-0.2, 1)}, {7: Logprob(-0.3, 1)}]

    def out(a_ids, a_text, b_ids, b_text, fa=None, fb=None):
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, a_text, a_ids, logprobs=lp[:len(a_ids)],
                                                                  finish_reason=fa),
                                                 CompletionOutput(1, b_text, b_ids, finish_reason=fb)],
                             False, num_cached_tokens=1)

    t = DeltaTracker()
    d = t.update(out([9], "x", [], ""))
    assert [(x.index, x.token_ids, x.text) for x in d] == [(0, [9], "x")] and d[0].logprobs == lp[:1]
    d = t.update(out([9, 8], "x", [5], "q"))  # text held back for seq 0, new token anyway
    assert [(x.index, x.token_ids, x.text) for x in d] == [(0, [8], ""), (1, [5], "q")]
    d = t.update(out([9, 8, 7], "xyz", [5], "q", fa="stop", fb="length"))
    assert [(x.index, x.token_ids, x.text, x.finish_reason) for x in d] == [(0, [7], "yz", "stop"),
                                                                            (1, [], "", "length")]
    assert t.update(out([9, 8, 7], "xyz", [5], "q", fa="stop", fb="length")) == []
    assert t.num_generated() == 4 and t.prompt_tokens == 2 and t.cached_tokens == 1
