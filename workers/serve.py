"""`k3serve serve MODEL_DIR`: one-process OpenAI-compatible server (engine + HTTP in one process).

Prints `k3serve serve: listening on http://HOST:PORT` (with the real port when `--port 0`) once it
accepts connections; a port that cannot be bound is one line naming it and `--port`, exit 2
(k3serve/common/ports.py). If the engine fails beyond containment (workers/async_engine.py) the server
stops and exits 1. `--api-key-file PATH` turns on Bearer auth for /v1/* (the key is never logged).
"""

from __future__ import annotations

import argparse
import logging
import sys

from k3serve.common.ports import bind_or_exit
from k3serve.workers.engine_cli import add_engine_args, run_uvicorn, setup_logging, start_engine

log = logging.getLogger("k3serve.serve")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--api-key-file", default=None, help="file holding the API key for Bearer auth")
    add_engine_args(parser)
    from k3serve.workers.kv_events_zmq import add_zmq_args

    add_zmq_args(parser)  # --kv-events-zmq: KV events in vLLM's format (workers/kv_events_zmq.py)


def run(args: argparse.Namespace) -> int:
    from k3serve.openai_api.errors import read_api_key_file
    from k3serve.workers.serving.app import build_app

    setup_logging(args.log_level)
    api_key = read_api_key_file(args.api_key_file) if args.api_key_file else None
    sock = bind_or_exit(args.host, args.port, flag="--port", prog="k3serve serve")  # before the engine loads
    served = start_engine(args, args.model)
    zmq_pub = None
    if args.kv_events_zmq:
        from k3serve.workers.kv_events_zmq import start_zmq_publisher

        zmq_pub = start_zmq_publisher(served.async_engine, args.kv_events_zmq, replay_endpoint=args.kv_events_zmq_replay,
                                      topic=args.kv_events_zmq_topic, fmt=args.kv_events_zmq_format)
    app = build_app(served.async_engine, served_model_names=served.model_names, registry=served.registry,
                    api_key=api_key)
    host, port = sock.getsockname()[:2]

    def ready() -> None:
        print(f"k3serve serve: listening on http://{host}:{port} (model {served.model_names[0]}, "
              f"max_model_len {served.async_engine.max_model_len})", flush=True)

    try:
        run_uvicorn(app, sock, log_level=args.log_level, on_ready=ready)
    finally:
        if zmq_pub is not None:
            zmq_pub.stop()
        served.async_engine.shutdown()
    if served.async_engine.error is not None:  # stopped because the engine failed (engine_cli.stop_process)
        print(f"k3serve serve: the engine failed: {served.async_engine.error}", file=sys.stderr, flush=True)
        return 1
    return 0
