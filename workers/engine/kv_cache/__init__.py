"""The device KV cache: a kind-free block pool (block_pool.py) with pluggable eviction (eviction.py),
one manager per cache-group kind (mla_manager.py, kda_manager.py) and the coordinator over them
(coordinator.py)."""
