"""Prefix-cache events: the type a worker publishes and the index a subscriber rebuilds from them."""
