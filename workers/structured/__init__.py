"""Structured outputs: XGrammar grammars that constrain sampling (docs/serving.md "Structured outputs").

Modules, one concept each:
* `vocab`: XGrammar's TokenizerInfo from the K3 tiktoken vocabulary (raw bytes; the XTML markers as
  token-only symbols, the other specials never allowed).
* `grammar`: `StructuredOutputsParams` -> an XGrammar structural tag (plain dict) + its cache key;
  `k3_tools`: the K3 tool-call region of it (calls and typed arguments per each tool's schema).
* `compile_cache`: validation (sync, raises `StructuredOutputError` with XGrammar's message) and the
  asynchronous, schema-keyed compile cache.
* `matcher`: per-sequence matcher state (fill bitmask row, accept, rollback).
* `bitmask`: applying packed token bitmasks to logits on their device.
* `stage`: the engine hook: holds a request until its grammar is compiled, then releases it to the
  scheduler with its matcher attached to its SamplingState.

xgrammar is imported lazily (about 1.5 s): only an engine that sees a constrained request pays it.
"""

from k3serve.workers.structured.errors import StructuredOutputError

__all__ = ["StructuredOutputError"]
