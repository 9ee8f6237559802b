"""Command-line engine options shared by `k3serve serve` and `k3serve worker`, and the engine bootstrap.

    add_engine_args(parser)                       # --max-model-len, --kv-cache-memory, ...
    served = start_engine(args)                   # LLMEngine + metrics + AsyncEngine (thread started)
    served.async_engine / served.registry / served.model_names

Bad option values exit with a clear message: argparse rejects malformed ones (exit 2, `error: argument
--block-size: ...`); values only the engine can judge (a prefix-match unit that does not divide the
block size, a KV budget too small for `--max-model-len`, a missing model directory) make `start_engine`
raise `EngineConfigError`, a SystemExit whose message `k3serve: error: ...` goes to stderr (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import threading
from dataclasses import dataclass

LOG_LEVELS = ("debug", "info", "warning", "error")


class EngineConfigError(SystemExit):
    """The engine rejected the options (the message says which); exits the CLI with status 1."""


def _memory(value: str) -> int | float:
    """Bytes (int, with optional K/M/G suffix) or a fraction in (0, 1] of free GPU memory."""
    v = value.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(v[-1:].lower())
    try:
        if mult:
            out: int | float = int(float(v[:-1]) * mult)
        elif "." in v:
            out = float(v)
        else:
            out = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {value!r} (bytes, e.g. 512M, or a fraction)") from None
    if isinstance(out, float) and not 0 < out <= 1:
        raise argparse.ArgumentTypeError(f"a fraction of free memory must be in (0, 1], got {value!r}")
    if isinstance(out, int) and out <= 0:
        raise argparse.ArgumentTypeError(f"the KV cache size must be positive, got {value!r}")
    return out


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def _retention(value: str) -> int | str:
    if value == "dense":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a retention interval: {value!r} (0, N or 'dense')") from None
    if n < 0:
        raise argparse.ArgumentTypeError("retention interval must be >= 0")
    return n


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in `model` (default: the model directory's name)")
    g.add_argument("--max-model-len", type=_positive_int, default=None, help="context length (prompt + output)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=64)
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048)
    g.add_argument("--block-size", type=_positive_int, default=None,
                   help="tokens per cache page (default: derived from the KDA state page size)")
    g.add_argument("--kv-cache-memory", type=_memory, default=None,
                   help="KV cache bytes (e.g. 256M) on CPU, or a fraction of free memory on CUDA")
    g.add_argument("--enable-prefix-caching", action="store_true")
    g.add_argument("--prefix-match-unit", type=_positive_int, default=None,
                   help="tokens per prefix-hash unit (must divide the block size)")
    g.add_argument("--prefix-cache-retention-interval", type=_retention, default=0,
                   help="KDA snapshot retention: 0 (boundaries only), N tokens, or 'dense'")
    g.add_argument("--prefix-cache-selective-retention", action="store_true",
                   help="keep KDA snapshots only on a second hit (Marconi-style)")
    g.add_argument("--prefix-cache-eviction", default="lru", choices=["lru", "compute-per-byte"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float64", "bfloat16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--enforce-eager", action="store_true",
                   help="never replay decode steps from captured CUDA graphs")
    g.add_argument("--cuda-graph-max-batch", type=_positive_int, default=256,
                   help="largest decode batch that gets a captured CUDA graph")
    g.add_argument("--num-threads", type=_positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def engine_args_from(args: argparse.Namespace, model: str):
    from k3serve.workers.engine.api import EngineArgs

    return EngineArgs(
        model=model, max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching, prefix_match_unit=args.prefix_match_unit,
        prefix_cache_retention_interval=args.prefix_cache_retention_interval,
        prefix_cache_selective_retention=args.prefix_cache_selective_retention,
        prefix_cache_eviction=args.prefix_cache_eviction, device=args.device, dtype=args.dtype, seed=args.seed,
        served_model_name=(args.served_model_name or [None])[0],
        enforce_eager=getattr(args, "enforce_eager", False),
        cuda_graph_max_batch=getattr(args, "cuda_graph_max_batch", 256),
    )


@dataclass
class ServedEngine:
    async_engine: object  # AsyncEngine
    registry: object  # prometheus CollectorRegistry
    model_names: list[str]


def start_engine(args: argparse.Namespace, model: str) -> ServedEngine:
    """Build the LLMEngine from the CLI options, wrap it in a started AsyncEngine with catalog metrics."""
    import prometheus_client
    import torch

    from k3serve.workers.async_engine import AsyncEngine
    from k3serve.workers.engine.llm_engine import LLMEngine
    from k3serve.workers.metrics import EngineMetrics

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        engine = LLMEngine.from_args(engine_args_from(args, model))
    except (ValueError, OSError) as e:  # bad option values, or no usable checkpoint at `model`
        raise EngineConfigError(f"k3serve: error: {e}") from None
    names = list(args.served_model_name or [engine.served_model_name])
    registry = prometheus_client.CollectorRegistry()
    metrics = EngineMetrics(registry, names[0])
    aeng = AsyncEngine(engine, model_name=names[0], metrics=metrics)
    aeng.start()
    return ServedEngine(aeng, registry, names)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port); port 0 picks a free port (read it from getsockname)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_uvicorn(app, sock: socket.socket, *, log_level: str, on_ready=None) -> None:
    """Serve `app` on the bound `sock` until SIGINT/SIGTERM; `on_ready()` runs once it accepts connections."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # Like uvicorn's, but without re-raising the signal after the graceful shutdown, so the
            # caller's cleanup runs and the process exits 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if on_ready is not None and not self.should_exit:
                on_ready()

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    _Server(config).run(sockets=[sock])
