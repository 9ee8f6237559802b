"""The engine's scheduling + input-preparation path as it was before the scheduler emitted deltas
(commit 6831ece: whole block tables resent every step), kept importable so that
benchmarks/engine_overhead.py measures it side by side with today's path in the same run."""
