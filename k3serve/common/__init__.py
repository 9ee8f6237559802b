"""Pieces shared by several components (metrics catalog, OpenAI protocol, hashing helpers)."""
