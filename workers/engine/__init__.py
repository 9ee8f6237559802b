"""The serving engine: requests, hybrid KV cache, scheduler, model runner, LLMEngine."""
