"""Speculative decoding in the engine: config, proposers (ngram, MTP), rollback schemes, acceptance."""
