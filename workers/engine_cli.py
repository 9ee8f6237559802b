"""Command-line engine options shared by `k3serve serve` and `k3serve worker`, and the engine bootstrap.

    add_engine_args(parser)                       # one flag per EngineArgs field, --num-threads, --log-level
    engine_args = engine_args_from(args, model)   # the EngineArgs those flags describe
    served = start_engine(args)                   # LLMEngine + metrics + AsyncEngine (thread started)
    served.async_engine / served.registry / served.model_names

Bad option values exit with a clear message: argparse rejects malformed ones (exit 2, `error: argument
--block-size: ...`); values only the engine can judge (a prefix-match unit that does not divide the
block size, a KV budget too small for `--max-model-len`, a missing model directory) make `start_engine`
raise `EngineConfigError`, a SystemExit whose message `k3serve: error: ...` goes to stderr (exit 1).

The engine flags are generated from the EngineArgs fields (workers/engine/api.py: type, default, help,
choices and validation are declared there once); the flags that are not engine fields are listed in
`HAND_WRITTEN` below.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass

from k3serve.common.ports import bind_socket  # noqa: F401 - re-exported (tests, ThreadServer)
from k3serve.workers.engine.api import positive_int

LOG_LEVELS = ("debug", "info", "warning", "error")


class EngineConfigError(SystemExit):
    """The engine rejected the options (the message says which); exits the CLI with status 1."""


# Flags that are not EngineArgs fields, per command (every other engine flag is generated from the
# fields: workers/engine/api.py says how to add one). tests/test_engine_args_cli.py checks that each
# flag of `serve` and `worker` is either generated or listed here, so this is the one list of them.
_ZMQ = {  # KV events in vLLM's ZMQ format: a publisher of the process (workers/kv_events_zmq.py)
    "--kv-events-zmq": "publish KV events over ZMQ", "--kv-events-zmq-replay": "the ZMQ replay endpoint",
    "--kv-events-zmq-topic": "the ZMQ topic", "--kv-events-zmq-format": "tagged arrays or tagged maps",
}
HAND_WRITTEN: dict[str, dict[str, str]] = {
    "serve": {
        "MODEL_DIR": "the positional checkpoint directory (becomes EngineArgs.model)",
        "--host": "bind address of the HTTP server", "--port": "HTTP port (0 picks a free one)",
        "--api-key-file": "Bearer auth for /v1/* (the server's, not the engine's)",
        "--num-threads": "torch CPU threads of the process", "--log-level": "process logging",
        **_ZMQ,
    },
    "worker": {
        "--model": "checkpoint directory (becomes EngineArgs.model; spelled as the pod contract does)",
        "--role": "prefill | decode | both: which half of the P/D split this process serves",
        "--host": "bind address of the gRPC and metrics servers", "--grpc-port": "gRPC port",
        "--grpc-uds": "an extra gRPC listener on a Unix-domain socket (k3serve up --store)",
        "--metrics-port": "/metrics, /health and /ready port",
        "--num-threads": "torch CPU threads of the process", "--log-level": "process logging",
        **_ZMQ,
    },
    "generate": {  # builds no EngineArgs from flags: `--engine reference` runs the reference forward
        "--model": "checkpoint directory", "--prompt-ids": "comma-separated token ids",
        "--max-tokens": "new tokens", "--engine": "reference (default: the plain forward, the oracle) | engine",
        "--dtype": "auto means float64 for the reference and the engine's own default for the engine",
        "--device": "torch device",
    },
}


def _argparse_type(parse):
    """argparse reports ArgumentTypeError messages as given; the field parsers raise ValueError."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _infer_parse(default):
    if isinstance(default, int):
        return _int
    if isinstance(default, float):
        return float
    return None  # str: argparse's own


def _int(text: str) -> int:  # an int field without its own parser
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def engine_flags():
    """(dataclasses.Field, Flag, option string) for every EngineArgs field that has a flag, in field order."""
    import dataclasses

    from k3serve.workers.engine.api import CLI, EngineArgs

    for f in dataclasses.fields(EngineArgs):
        spec = f.metadata.get(CLI)
        if spec is not None:
            yield f, spec, spec.flag or "--" + f.name.replace("_", "-")


def is_switch(f) -> bool:
    """A bool field (annotation `bool` or `bool | None`): a flag without a value."""
    return isinstance(f.default, bool) or str(f.type).replace(" ", "") in ("bool", "bool|None", "None|bool")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags, generated from the EngineArgs fields, plus --num-threads and --log-level."""
    g = p.add_argument_group("engine")
    for f, spec, opt in engine_flags():
        default = f.default
        help_ = spec.help
        if default is not None and default is not False and "default" not in help_:
            help_ += " (default: %(default)s)"
        kw: dict = {"dest": f.name, "default": default, "help": help_}
        if is_switch(f):
            # a switch: False -> --flag; None -> --flag/--no-flag (unset: the engine decides)
            kw["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        else:
            parse = spec.parse or _infer_parse(default)
            if parse is not None:
                kw["type"] = _argparse_type(parse)
            if spec.choices:
                kw["choices"] = list(spec.choices)
            if spec.nargs:
                kw["nargs"] = spec.nargs
            if spec.metavar:
                kw["metavar"] = spec.metavar
        g.add_argument(opt, *spec.aliases, **kw)
    g.add_argument("--num-threads", type=_argparse_type(positive_int), default=None,
                   help="torch CPU threads, of every rank of a multi-rank engine (default: torch's; with more "
                        "than one rank, each rank's share of the host's CPUs)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def engine_args_from(args: argparse.Namespace, model: str):
    """EngineArgs(model=model, <every generated flag's value>)."""
    from k3serve.workers.engine.api import EngineArgs

    values = {}
    for f, spec, _opt in engine_flags():
        v = getattr(args, f.name, f.default)
        values[f.name] = spec.to_field(v) if spec.to_field else v
    return EngineArgs(model=model, **values)


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
        from k3serve.workers.engine.parallel.threads import ENV  # a multi-rank engine: every rank's threads

        os.environ[ENV] = str(args.num_threads)
    try:
        engine = LLMEngine.from_args(engine_args_from(args, model))
    except (ValueError, OSError) as e:  # bad option values, or no usable checkpoint at `model`
        raise EngineConfigError(f"k3serve: error: {e}") from None
    names = list(args.served_model_name or [engine.served_model_name])
    registry = prometheus_client.CollectorRegistry()
    metrics = EngineMetrics(registry, names[0])
    from k3serve.workers.engine.parallel.launcher import parallel_layout

    metrics.on_layout(parallel_layout(engine))  # what the engine runs: tp, dp, ep, sp, nnodes
    aeng = AsyncEngine(engine, model_name=names[0], metrics=metrics, on_fatal=stop_process)
    check_peers = getattr(engine.runner, "check_peers", None)  # a TP group: a dead rank is fatal, idle or not
    if check_peers is not None:
        aeng.add_engine_hook(check_peers)
    aeng.start()
    return ServedEngine(aeng, registry, names)


def stop_process() -> None:
    """The engine failed beyond containment: SIGTERM this process, whose server shuts down and, seeing the
    engine's error, exits 1 (so a supervisor restarts it). Called from the engine thread."""
    logging.getLogger("k3serve").critical("the engine cannot serve any more; stopping the process")
    os.kill(os.getpid(), signal.SIGTERM)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
