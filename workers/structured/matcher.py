"""Per-sequence grammar state: XGrammar's matcher plus what the sampler needs from it.

The sampler (workers/sample/constraints.py) fills one bitmask row per constrained row before
sampling and calls `accept` with the sampled token after; speculative decoding would fill a row
per draft position (accepting each draft token in turn) and `rollback` the rejected ones.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class GrammarState:
    __slots__ = ("matcher", "num_accepted", "failed", "guard", "last_tokens")

    def __init__(self, compiled_grammar, guard=None):
        """`guard`: a vocab.MarkerGuard for K3 chat outputs (None: the grammar's mask alone)."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.num_accepted = 0
        self.failed = False  # a token the grammar rejected was appended: no longer constrained
        self.guard = guard
        self.last_tokens: list[int] = []  # accepted tokens (the guard looks at the last one)

    @property
    def active(self) -> bool:
        """Whether the next token is constrained (not failed, not past the end of turn)."""
        return not self.failed and not self.matcher.is_terminated()

    def fill(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.apply_guard(bitmask, row)

    def apply_guard(self, bitmask, row: int) -> None:
        if self.guard is not None:
            self.guard.apply(bitmask[row], self.last_tokens[-1] if self.last_tokens else None)

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.accept_token(int(token_id))
        if ok:
            self.num_accepted += 1
            if self.guard is not None:
                self.last_tokens.append(int(token_id))
        else:
            self.failed = True
            log.error("structured outputs: the grammar rejected sampled token %d; the rest of this sequence "
                      "is unconstrained", token_id)
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts)."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            if self.guard is not None:
                del self.last_tokens[-num_tokens:]


def fill_bitmasks(states: list[GrammarState], vocab_size: int):
    """Tensor[len(states), ceil(V/32)] int32 (CPU): row j = the tokens states[j] allows next."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    if len(states) < BATCH_FILL_MIN_ROWS:
        for j, s in enumerate(states):
            s.fill(bitmask, j)
    else:
        _batch_matcher().batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
        for j, s in enumerate(states):
            s.apply_guard(bitmask, j)
    return bitmask


# One fill is ~5-20 us, while XGrammar's threaded batch fill costs ~4 ms of thread start-up per call with
# 16 threads on the H200 host (benchmarks/structured_overhead.py): fill row by row below this many rows.
BATCH_FILL_MIN_ROWS = 256
_BATCH = None


def _batch_matcher():
    global _BATCH
    if _BATCH is None:
        import os

        import xgrammar as xgr

        _BATCH = xgr.BatchGrammarMatcher(max_threads=min(4, os.cpu_count() or 1))
    return _BATCH
