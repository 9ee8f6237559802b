"""KV connectors: the API (base.py), composition of tiers (composite.py), the registry (factory.py)
and the host-memory offload tier (host_offload.py). Guide: docs/architecture.md, "KV connector API"."""
