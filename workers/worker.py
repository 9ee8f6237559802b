"""`k3serve worker --model DIR --role both --grpc-port P --metrics-port M`: the engine behind gRPC.

One process, one asyncio loop: the gRPC Worker service (worker.proto) on `--grpc-port` and a small
HTTP server on `--metrics-port` with `/metrics` (Prometheus), `/health` (liveness: the process and
its engine thread are alive) and `/ready` (readiness: healthy and able to accept requests). Port 0
picks a free port. Prints `k3serve worker: ready grpc=HOST:P metrics=http://HOST:M` once both listen.
`--role prefill|decode` adds the NIXL P/D connector (docs/serving.md "P/D: prefill, then decode").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from k3serve.common.ports import bind_or_exit, check_port_free, exit_on_bind_error
from k3serve.workers.engine_cli import add_engine_args, setup_logging, start_engine

log = logging.getLogger("k3serve.worker")
PROG = "k3serve worker"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument("--role", default="both", choices=["both", "prefill", "decode"])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--grpc-uds", default=None, metavar="PATH",
                        help="also serve gRPC on the Unix-domain socket PATH (k3serve up --store reaches "
                             "workers in a private network namespace this way)")
    parser.add_argument("--metrics-port", type=int, default=9100, help="0 picks a free port")
    # The parallel layout (--tensor-parallel-size, --data-parallel-size, --enable-expert-parallel) and the store
    # address (--kv-store) are EngineArgs fields; what is not implemented is refused below with a clear message.
    add_engine_args(parser)
    from k3serve.workers.kv_events_zmq import add_zmq_args

    add_zmq_args(parser)  # --kv-events-zmq: KV events in vLLM's format too (workers/kv_events_zmq.py)


def unsupported_layout(args: argparse.Namespace) -> str | None:
    """Why this process cannot run the requested layout yet, or None."""
    # DEP (--data-parallel-size): workers/engine/parallel/dp_front.py judges the model; --role prefill and
    # decode: every rank its own NIXL connector (workers/kv_transfer/dp_group.py)
    from k3serve.workers.engine.parallel.nodes import group_size, layout_problem  # groups spanning nodes

    size, what = group_size(args)  # DEP groups span nodes too (workers/engine/parallel/dp_engine.py)
    nodes_problem = layout_problem(size, getattr(args, "nnodes", 1),  # k3serve up asks too
                                   getattr(args, "node_rank", 0), what)
    if nodes_problem:
        return nodes_problem.replace("nnodes", "--nnodes").replace("node_rank", "--node-rank").replace(
            "tensor_parallel_size", "--tensor-parallel-size").replace("data_parallel_size", "--data-parallel-size")
    return None


def add_role_connectors(args: argparse.Namespace) -> None:
    """`--role prefill|decode`: the engine gets the NIXL P/D connector (workers/kv_transfer/);
    `both` (colocated) needs none."""
    if args.role in ("prefill", "decode") and "nixl" not in (args.kv_connectors or ()):
        args.kv_connectors = tuple(args.kv_connectors or ()) + ("nixl",)


def attach_transfer_metrics(engine, served) -> None:
    """Transfer metrics on the ledger; and an idle engine still polls its connector (at the engine
    thread's idle wait, 0.25 s), so pages pinned for a decode worker are released when it confirms."""
    from k3serve.workers.kv_transfer.grpc_pd import find_nixl

    llm = getattr(engine, "engine", None)
    nixl = find_nixl(llm)
    if nixl is None:
        return
    from k3serve.workers.kv_transfer.metrics import TransferMetrics

    nixl.ledger.metrics = TransferMetrics(served.registry, served.model_names[0])
    pending = getattr(llm, "has_pending_connector_work", None)  # a DEP front: every rank's pinned pages

    def poll_when_idle() -> None:
        if pending is not None and pending() and not llm.has_unfinished_requests():
            llm.step()

    engine.add_engine_hook(poll_when_idle)


def build_metrics_app(engine, registry):
    from fastapi import FastAPI

    from k3serve.openai_api.errors import install_error_handlers
    from k3serve.workers.serving.app import health_response, metrics_response

    app = FastAPI(title="k3serve worker", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.get("/metrics")
    async def metrics():
        return metrics_response(registry)

    @app.get("/health")
    async def health():
        return health_response(engine)

    @app.get("/ready")
    async def ready():
        return health_response(engine)

    return app


async def _serve(args: argparse.Namespace, msock) -> int:
    import uvicorn

    from k3serve.workers.grpc_service import start_grpc_server

    served = await asyncio.to_thread(start_engine, args, args.model)
    engine = served.async_engine
    attach_transfer_metrics(engine, served)
    try:
        with exit_on_bind_error(args.host, args.grpc_port, flag="--grpc-port", prog=PROG):
            grpc_server = await start_grpc_server(engine, host=args.host, port=args.grpc_port, role=args.role,
                                                  model_name=served.model_names[0],
                                                  extra_addresses=(f"unix:{args.grpc_uds}",) if args.grpc_uds else ())
    except BaseException:
        engine.shutdown()
        raise

    class _Server(uvicorn.Server):
        def capture_signals(self):  # the worker handles signals itself
            import contextlib

            return contextlib.nullcontext()

    http = _Server(uvicorn.Config(build_metrics_app(engine, served.registry), log_level=args.log_level,
                                  access_log=False, lifespan="off"))
    http_task = asyncio.ensure_future(http.serve(sockets=[msock]))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)
    if http_task.done():
        await grpc_server.stop(None)
        engine.shutdown()
        http_task.result()
        return 1
    zmq_pub = None
    if args.kv_events_zmq:
        from k3serve.workers.kv_events_zmq import start_zmq_publisher

        zmq_pub = start_zmq_publisher(engine, args.kv_events_zmq, replay_endpoint=args.kv_events_zmq_replay,
                                      topic=args.kv_events_zmq_topic, fmt=args.kv_events_zmq_format)
    mhost, mport = msock.getsockname()[:2]
    print(f"k3serve worker: ready grpc={args.host}:{grpc_server.port} metrics=http://{mhost}:{mport} "
          f"role={args.role} model={served.model_names[0]}"
          + (f" uds=unix:{args.grpc_uds}" if args.grpc_uds else ""), flush=True)
    try:
        await asyncio.wait({asyncio.ensure_future(stop.wait()), http_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        http.should_exit = True
        if zmq_pub is not None:
            zmq_pub.stop()
        await grpc_server.stop(2.0)
        await asyncio.wait({http_task}, timeout=5)
        engine.shutdown()
    if engine.error is not None:  # stopped because the engine failed (engine_cli.stop_process)
        print(f"k3serve worker: the engine failed: {engine.error}", flush=True)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    from k3serve.workers.engine.parallel.nodes import placement_from_env

    problem = placement_from_env(args) or unsupported_layout(args)  # the pod's K3SERVE_NUM_NODES, ...
    if not problem:  # a --model URI is fetched into $K3SERVE_HOME; K3SERVE_SERVED_MODEL_NAME names it
        from k3serve.workers.model.acquire import prepare_worker_model

        problem = prepare_worker_model(args)
    if problem:
        print(f"k3serve worker: {problem}", flush=True)
        return 2
    if args.node_rank > 0:  # a non-leader node of a group: ranks only (workers/engine/parallel/node_process.py)
        from k3serve.workers.engine.parallel.node_process import run_node

        return run_node(args, bind_or_exit(args.host, args.metrics_port, flag="--metrics-port", prog=PROG))
    add_role_connectors(args)
    # both ports are checked before the engine loads (minutes for a real checkpoint)
    msock = bind_or_exit(args.host, args.metrics_port, flag="--metrics-port", prog=PROG)
    check_port_free(args.host, args.grpc_port, flag="--grpc-port", prog=PROG)
    return asyncio.run(_serve(args, msock))
