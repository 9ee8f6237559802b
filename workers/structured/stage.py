"""The engine's structured-output hook: a request with a grammar waits here, not in the scheduler,
until its grammar is compiled; the other requests keep running meanwhile.

    stage = StructuredStage(lambda: engine.tokenizer, vocab_size)
    stage.check(params)                  # add_request: raises StructuredOutputError (a ValueError) -> 400
    if not stage.hold(req, sampling):    # add_request: True = held until compiled
        scheduler.add(req)
    for req in stage.pop_ready(block=not scheduler.has_unfinished()):   # start of step()
        scheduler.add(req)               # its SamplingState now carries the GrammarState
    engine unfinished = scheduler.has_unfinished() or bool(stage)

A held request that gets aborted (its status finished) is dropped at the next `pop_ready`. A grammar
whose background compile fails (validation already passed, so only an internal XGrammar failure)
raises from `pop_ready` once, after dropping its requests: the step fails, and the serving layer's
step-failure containment (workers/async_engine.py) fails the requests in flight with a 500.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait

from k3serve.sampling_params import SamplingParams
from k3serve.workers.structured.errors import StructuredOutputError


class StructuredStage:
    def __init__(self, tokenizer: Callable[[], object], vocab_size: int, *, block_wait_s: float = 0.05):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.block_wait_s = block_wait_s
        self._cache = None
        self._held: list[tuple[object, object, object]] = []  # (Request, SamplingState, Future)

    @property
    def cache(self):
        """The engine's GrammarCompileCache (created, and xgrammar imported, on first use)."""
        if self._cache is None:
            tok = self._tokenizer()
            if tok is None:
                raise StructuredOutputError("structured outputs need the tokenizer (the engine runs with "
                                            "skip_tokenizer_init)")
            from k3serve.workers.structured.compile_cache import GrammarCompileCache

            self._cache = GrammarCompileCache(tok, self.vocab_size)
        return self._cache

    @staticmethod
    def constrained(params: SamplingParams) -> bool:
        so = params.structured_outputs
        return so is not None and so.constrains

    def check(self, params: SamplingParams) -> None:
        if self.constrained(params):
            self.cache.prepare(params.structured_outputs)

    def hold(self, req, sampling_state) -> bool:
        if not self.constrained(req.params):
            return False
        cache = self.cache
        fut = cache.compile(cache.prepare(req.params.structured_outputs))
        self._held.append((req, sampling_state, fut))
        return True

    def pop_ready(self, block: bool = False) -> list:
        """Held requests whose grammar is ready (matcher attached), in arrival order.

        `block`: nothing else can run, so wait up to `block_wait_s` for a compile instead of spinning.
        A failed compile raises here once (its requests are dropped from the stage first).
        """
        if not self._held:
            return []
        if block and not any(f.done() for _, _, f in self._held):
            wait([f for _, _, f in self._held], timeout=self.block_wait_s, return_when=FIRST_COMPLETED)
        failed = [item for item in self._held if item[2].done() and item[2].exception() is not None]
        if failed:
            self._held = [item for item in self._held if item not in failed]
            raise failed[0][2].exception()
        from k3serve.workers.structured.matcher import GrammarState

        ready, keep = [], []
        for item in self._held:
            req, state, fut = item
            if req.is_finished:
                continue
            if not fut.done():
                keep.append(item)
                continue
            guard = self.cache.marker_guard if req.params.structured_outputs.k3_chat else None
            state.structured = GrammarState(fut.result(), guard)
            ready.append(req)
        self._held = keep
        return ready

    def __len__(self) -> int:
        return sum(1 for req, _, _ in self._held if not req.is_finished)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
