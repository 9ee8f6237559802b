"""HTTP serving: the OpenAI-compatible FastAPI app (`app.build_app`) and its engine-free output builders
(`deltas`, `chat_output`, `completion_output`, `logprobs`) that the router reuses."""
