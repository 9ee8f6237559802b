"""`k3serve router`: the OpenAI-compatible gateway in front of the workers (pod contract: docs/components.md).

    k3serve router --model DIR --workers 127.0.0.1:50051,127.0.0.1:50052 [--port 8000] [--policy hybrid-prefix]
    k3serve router --host $(K3SERVE_POD_IP) --port 8000 --metrics-port 9100 --discovery kubernetes \\
        [--prefill-selector LABELS] --decode-selector LABELS --policy NAME [--api-key-file PATH]

The router needs the model's tokenizer and config (to render, tokenize and hash requests exactly as the
workers do): `--model DIR` or `$K3SERVE_MODEL_DIR`. Prints `k3serve router: listening on http://HOST:PORT
metrics=http://HOST:M policy=NAME` once both servers listen (port 0 picks a free one). SIGTERM/SIGINT
drains: new requests get 503, running ones finish (up to `--drain-timeout` seconds), then it exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys

from k3serve.router.policy import POLICIES

log = logging.getLogger("k3serve.router")


def _addresses(value: str) -> list[str]:
    out = [a.strip() for a in value.split(",") if a.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected HOST:PORT[,HOST:PORT...]")
    for a in out:
        if not a.startswith("unix:") and (":" not in a or not a.rsplit(":", 1)[1].isdigit()):
            raise argparse.ArgumentTypeError(f"not a HOST:PORT or unix: address: {a!r}")
    return out


def _positive(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    return v


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address of the HTTP and metrics servers")
    p.add_argument("--port", type=int, default=8000, help="the OpenAI API (0 picks a free port)")
    p.add_argument("--metrics-port", type=int, default=9100, help="/metrics and /health (0 picks a free port)")
    p.add_argument("--discovery", default="static", choices=["static", "kubernetes"])
    p.add_argument("--workers", type=_addresses, default=[], metavar="ADDRS",
                   help="static discovery: colocated (--role both) workers, HOST:PORT[,...]")
    p.add_argument("--prefill-workers", type=_addresses, default=[], metavar="ADDRS",
                   help="static discovery: prefill workers")
    p.add_argument("--decode-workers", type=_addresses, default=[], metavar="ADDRS",
                   help="static discovery: decode workers")
    p.add_argument("--prefill-selector", default=None, metavar="LABELS", help="kubernetes: prefill group leaders")
    p.add_argument("--decode-selector", default=None, metavar="LABELS", help="kubernetes: decode group leaders")
    p.add_argument("--namespace", default=os.environ.get("K3SERVE_NAMESPACE"), help="kubernetes namespace")
    p.add_argument("--policy", default="hybrid-prefix", choices=POLICIES)
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="clients must send Authorization: Bearer")
    p.add_argument("--model", default=os.environ.get("K3SERVE_MODEL_DIR"), metavar="DIR",
                   help="checkpoint directory: tokenizer, config, fingerprint (default $K3SERVE_MODEL_DIR)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names clients use in `model` (default $K3SERVE_SERVED_MODEL_NAME or the directory name)")
    p.add_argument("--prefix-match-unit", type=int, default=None,
                   help="the workers' --prefix-match-unit (default: their block size, as the workers default)")
    p.add_argument("--max-model-len", type=int, default=0, help="cap on the context (default: the workers')")
    p.add_argument("--request-timeout", type=_positive, default=600.0, help="seconds per request (504 after)")
    p.add_argument("--drain-timeout", type=_positive, default=25.0, help="seconds to finish requests on SIGTERM")
    p.add_argument("--health-interval", type=_positive, default=1.0, help="seconds between health checks")
    p.add_argument("--max-attempts", type=int, default=3, help="workers a sequence may try")
    p.add_argument("--prefill-weight", type=float, default=1.0, help="cost per uncached prompt token")
    p.add_argument("--load-weight", type=float, default=1.0, help="cost per token of load")
    p.add_argument("--request-tokens", type=int, default=32,
                   help="load of one running request, in prefill-token equivalents")
    p.add_argument("--pd-threshold", type=int, default=64,
                   help="P/D: skip the prefill hop when the decode worker would compute at most this many tokens")
    p.add_argument("--prefill-timeout", type=_positive, default=300.0, help="P/D: seconds for the prefill hop")
    p.add_argument("--store-lookup-timeout", type=float, default=0.02, metavar="SECONDS",
                   help="bound on the one StoreLookup per request (the store's hit counts as 0 after it; 0: no lookups)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _fail(msg: str) -> int:
    print(f"k3serve router: {msg}", file=sys.stderr, flush=True)
    return 2


def _model_facts(model_dir: str) -> tuple[object, int, bytes]:
    from k3serve.common.block_hash import model_fingerprint
    from k3serve.tokenizer import K3Tokenizer

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    vocab = (cfg.get("text_config") or cfg).get("vocab_size")
    tok = K3Tokenizer.from_dir(model_dir)
    return tok, int(vocab or len(tok)), model_fingerprint(model_dir)


def static_workers(args) -> dict[str, str]:
    wanted = {a: "both" for a in args.workers}
    wanted.update({a: "prefill" for a in args.prefill_workers})
    wanted.update({a: "decode" for a in args.decode_workers})
    return wanted


async def serve(args, *, ready=None) -> int:
    import uvicorn

    from k3serve.openai_api.errors import read_api_key_file
    from k3serve.router.dispatch import Dispatcher
    from k3serve.router.gateway import Gateway, build_app
    from k3serve.router.metrics import RouterMetrics
    from k3serve.router.policy import Weights, make_policy
    from k3serve.router.prefix_index import PrefixIndex
    from k3serve.router.registry import Registry
    from k3serve.workers.engine_cli import bind_socket

    if args.model and "://" in args.model:  # a model URI: fetched into $K3SERVE_HOME as the workers do
        from k3serve.workers.model.acquire import AcquireError, resolve_model

        try:
            args.model = str(resolve_model(args.model))
        except (AcquireError, OSError) as e:
            return _fail(f"cannot fetch the model: {e}")
    try:
        tok, vocab, fp = _model_facts(args.model)
    except (OSError, ValueError, KeyError) as e:
        return _fail(f"cannot read the model at {args.model}: {e}")
    api_key = None
    if args.api_key_file:
        try:
            api_key = read_api_key_file(args.api_key_file)
        except (OSError, ValueError) as e:
            return _fail(f"--api-key-file: {e}")
    names = args.served_model_name or [os.environ.get("K3SERVE_SERVED_MODEL_NAME")
                                       or os.path.basename(os.path.normpath(args.model))]
    try:
        sock = bind_socket(args.host, args.port)
        msock = bind_socket(args.host, args.metrics_port)
    except OSError as e:
        return _fail(f"cannot listen on {args.host}: {e.strerror or e}")
    sock.listen(1024)
    msock.listen(128)
    metrics = RouterMetrics(names[0])
    index = PrefixIndex()
    registry = Registry(index, health_interval=args.health_interval,
                        on_change=lambda: metrics.workers(registry.counts()))
    policy = make_policy(args.policy, Weights(args.prefill_weight, args.load_weight, args.request_tokens), args.seed)
    dispatcher = Dispatcher(registry, index, policy, fingerprint=fp, unit=args.prefix_match_unit, metrics=metrics,
                            model_name=names[0], tokenizer=tok, max_attempts=args.max_attempts, role="decode",
                            pd_threshold=args.pd_threshold, prefill_timeout=args.prefill_timeout,
                            store_timeout=args.store_lookup_timeout)
    gw = Gateway(tokenizer=tok, model_names=list(names), vocab_size=vocab, dispatcher=dispatcher, metrics=metrics,
                 max_model_len=args.max_model_len, request_timeout=args.request_timeout)
    discovery = None
    if args.discovery == "kubernetes":
        from k3serve.router.kube import KubernetesDiscovery

        discovery = KubernetesDiscovery(registry, namespace=args.namespace, prefill_selector=args.prefill_selector,
                                        decode_selector=args.decode_selector)
        await discovery.start()
    else:
        await registry.set_workers(static_workers(args))

    app = build_app(gw, api_key=api_key)
    from k3serve.router.gateway import build_metrics_app

    class _Server(uvicorn.Server):
        def capture_signals(self):
            return contextlib.nullcontext()

    http = _Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                  timeout_graceful_shutdown=2))
    mhttp = _Server(uvicorn.Config(build_metrics_app(gw), log_level="warning", access_log=False, lifespan="off"))
    tasks = [asyncio.ensure_future(http.serve(sockets=[sock])), asyncio.ensure_future(mhttp.serve(sockets=[msock]))]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    while not (http.started and mhttp.started) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.01)
    host, port = sock.getsockname()[:2]
    mport = msock.getsockname()[1]
    print(f"k3serve router: listening on http://{host}:{port} metrics=http://{host}:{mport} policy={policy.name} "
          f"model={names[0]}", flush=True)
    if ready is not None:
        ready(port, mport)
    try:
        await asyncio.wait({asyncio.ensure_future(stop.wait()), *tasks}, return_when=asyncio.FIRST_COMPLETED)
        gw.draining = True
        log.info("draining: %d request(s) in flight", gw.inflight)
        deadline = loop.time() + args.drain_timeout
        while gw.inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
    finally:
        http.should_exit = mhttp.should_exit = True
        await asyncio.wait(tasks, timeout=5)
        if discovery is not None:
            await discovery.stop()
        await registry.close()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.model:
        return _fail("--model DIR (or $K3SERVE_MODEL_DIR) is required: the router tokenizes and hashes requests "
                     "with the model's tokenizer")
    if args.discovery == "static" and not (args.workers or args.decode_workers):
        return _fail("static discovery needs --workers or --decode-workers")
    if args.discovery == "kubernetes" and not args.decode_selector:
        return _fail("--discovery kubernetes needs --decode-selector")
    if args.discovery == "kubernetes" and not args.namespace:
        return _fail("--discovery kubernetes needs --namespace or $K3SERVE_NAMESPACE")
    if args.prefix_match_unit is not None and args.prefix_match_unit <= 0:
        return _fail("--prefix-match-unit must be positive")
    return asyncio.run(serve(args))
