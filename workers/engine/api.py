"""The engine's public contract, used by the offline `LLM`, `k3serve serve` and the gRPC worker.

    engine = LLMEngine.from_args(EngineArgs(model=DIR, ...))
    engine.add_request(request_id, prompt_token_ids, SamplingParams(...), cache_salt=None)
    while engine.has_unfinished_requests():
        for out in engine.step():          # list[RequestOutput]; only requests that changed
            ...                            # out.outputs[i].token_ids / .text are cumulative
    engine.abort_request([request_id])     # finish_reason "abort", freed at once

Thread-safety: LLMEngine is single-threaded. AsyncEngine (workers/async_engine.py) runs it on one
background thread and hands add/abort calls over through a queue.

`RequestOutput.outputs[i]` is cumulative (all tokens so far); streaming layers compute deltas.
With n > 1 a request fans out into n sequences that share the prompt; outputs carry all n.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineArgs:
    model: str
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int | None = None  # default: derived from the KDA page size (design doc §2)
    kv_cache_memory: int | float | None = None  # bytes on CPU; a fraction of free memory on CUDA
    enable_prefix_caching: bool = False
    prefix_match_unit: int | None = None
    prefix_cache_retention_interval: int | str = 0  # 0 | N | "dense"
    prefix_cache_selective_retention: bool = False
    prefix_cache_eviction: str = "lru"  # lru | compute-per-byte
    device: str = "cpu"
    dtype: str = "auto"  # auto (bf16 on CUDA, float32 on CPU) | float32 | float64 | bfloat16
    seed: int = 0
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False  # serve token ids only (no detokenization, no stop strings)
    enforce_eager: bool = False  # never run decode steps as captured CUDA graphs
    cuda_graph_max_batch: int = 256  # largest decode batch with a captured graph
    static_decode: bool | None = None  # fixed-shape padded decode steps (default: on CUDA only)
