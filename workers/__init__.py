"""k3serve.workers: the serving engine (model, hybrid cache, scheduler, sampler, servers).

`from k3serve.workers import LLM, SamplingParams` is the offline API. The names are resolved lazily
so that importing `k3serve.workers.model` (e.g. on a GPU box with only torch/triton) pulls in nothing
else.
"""

from __future__ import annotations

_EXPORTS = {
    "LLM": "k3serve.workers.llm",
    "SamplingParams": "k3serve.sampling_params",
    "RequestOutput": "k3serve.outputs",
    "CompletionOutput": "k3serve.outputs",
    "EngineArgs": "k3serve.workers.engine.api",
    "LLMEngine": "k3serve.workers.engine.llm_engine",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'k3serve.workers' has no attribute {name!r}")
