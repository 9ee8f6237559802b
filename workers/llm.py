"""Offline API in vLLM's shape: `LLM(model=DIR, ...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence

from k3serve.outputs import RequestOutput
from k3serve.sampling_params import SamplingParams
from k3serve.workers.engine.api import EngineArgs
from k3serve.workers.engine.llm_engine import LLMEngine


class LLM:
    # generate/chat keep finished outputs only, so the engine builds no others (LLMEngine.final_outputs_only);
    # False: one output per request per step as before (benchmarks/decode_roofline.py's "graphs-s6" mode)
    final_outputs_only = True

    def __init__(self, model: str, *, max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int = 64, block_size: int | None = None,
                 kv_cache_memory: int | float | None = None, enable_prefix_caching: bool = False,
                 device: str = "cpu", dtype: str = "auto", seed: int = 0, **cache_options):
        self.engine = LLMEngine.from_args(EngineArgs(
            model=str(model), max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, block_size=block_size, kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching, device=device, dtype=dtype, seed=seed,
            **cache_options))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, cache_salt: str | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError("sampling_params: need one per prompt or a single one")
        order = []
        for p, sp in zip(prompts, params):
            rid = self.engine.next_request_id()
            if isinstance(p, str):
                self.engine.add_request(rid, self.tokenizer.encode(p), sp.clone(), cache_salt=cache_salt, prompt=p)
            else:
                self.engine.add_request(rid, list(p), sp.clone(), cache_salt=cache_salt)
            order.append(rid)
        return self._run(order)

    def chat(self, messages, sampling_params: SamplingParams | None = None, *, tools=None,
             chat_template_kwargs: dict | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        from k3serve.chat.renderer import render_chat

        convs = messages if messages and isinstance(messages[0], list) else [messages]
        sp = sampling_params or SamplingParams()
        order = []
        for conv in convs:
            rendered = render_chat(self.tokenizer, conv, tools=tools, **(chat_template_kwargs or {}))
            p = sp.clone()
            p.skip_special_tokens = False
            rid = self.engine.next_request_id()
            self.engine.add_request(rid, rendered.token_ids, p, cache_salt=cache_salt)
            order.append(rid)
        return self._run(order)

    def _run(self, order: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        want = set(order)
        eng = self.engine
        before = eng.final_outputs_only
        eng.final_outputs_only = self.final_outputs_only  # only finished outputs are kept here
        try:
            while want - done.keys():
                for out in eng.step():
                    if out.finished and out.request_id in want:
                        done[out.request_id] = out
        finally:
            eng.final_outputs_only = before
        return [done[r] for r in order]
