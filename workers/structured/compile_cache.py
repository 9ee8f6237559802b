"""Validation and the asynchronous, schema-keyed grammar compile cache (one per engine).

`prepare(so)` runs on the caller's thread: it builds the structural tag and XGrammar's `Grammar` from
it (parsing the JSON schema / regex / EBNF: fast, no vocabulary), so an invalid or unsupported
request fails at once with `StructuredOutputError` carrying XGrammar's message (HTTP 400).
`compile(key)` returns a Future of the `CompiledGrammar` (the token-mask tables over the whole
vocabulary: the slow part), computed on one background thread; identical constraints share one
entry (LRU, `max_entries`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from k3serve.sampling_params import StructuredOutputsParams
from k3serve.workers.structured.errors import StructuredOutputError, xgrammar_message
from k3serve.workers.structured.grammar import cache_key, structural_tag
from k3serve.workers.structured.vocab import MarkerGuard, Markers, tokenizer_info


class GrammarCompileCache:
    def __init__(self, tokenizer, vocab_size: int, *, max_entries: int = 256, compile_threads: int = 2):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.markers = Markers.from_tokenizer(tokenizer)
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size)
        self._tokenizer = tokenizer
        self._guard = None
        # our own cache is the one source of truth; XGrammar's would keep a second copy
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads, cache_enabled=False)
        self.max_entries = max_entries
        self._grammars: OrderedDict[str, object] = OrderedDict()
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3serve-grammar")
        self.stats = {"hits": 0, "misses": 0, "compile_seconds": 0.0}

    def prepare(self, so: StructuredOutputsParams) -> str:
        """Validate `so` and return its cache key; raises StructuredOutputError (XGrammar's message)."""
        key = cache_key(so)
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return key
        tag = structural_tag(so, self.markers)
        try:
            grammar = self._xgr.Grammar.from_structural_tag(tag)
        except (RuntimeError, ValueError, TypeError) as e:
            raise StructuredOutputError(f"structured outputs: {xgrammar_message(e)}") from None
        with self._lock:
            self._grammars[key] = grammar
            self._trim(self._grammars)
        return key

    def compile(self, key: str) -> Future:
        """Future[CompiledGrammar] for a key from `prepare` (shared by every request with that key)."""
        with self._lock:
            fut = self._compiled.get(key)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._compiled.move_to_end(key)
                self.stats["hits"] += 1
                return fut
            grammar = self._grammars[key]
            self.stats["misses"] += 1
            fut = self._pool.submit(self._compile, grammar)
            self._compiled[key] = fut
            self._trim(self._compiled)
            return fut

    @property
    def marker_guard(self) -> MarkerGuard:
        """The vocabulary's MarkerGuard (built on first use; K3 chat outputs use it)."""
        if self._guard is None:
            self._guard = MarkerGuard.build(self._tokenizer, self.vocab_size)
        return self._guard

    def compile_now(self, so: StructuredOutputsParams):
        """Prepare and compile on this thread (tests, benchmarks); returns the CompiledGrammar."""
        return self.compile(self.prepare(so)).result()

    def _compile(self, grammar):
        t0 = time.perf_counter()
        try:
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise StructuredOutputError(f"structured outputs: {xgrammar_message(e)}") from None
        finally:
            self.stats["compile_seconds"] += time.perf_counter() - t0

    def _trim(self, d: OrderedDict) -> None:
        while len(d) > self.max_entries:
            d.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
