"""The OpenAI API shared by the one-process server and the gateway: request models and validation,
error bodies, streaming deltas, and the builders that turn engine deltas into OpenAI responses."""
