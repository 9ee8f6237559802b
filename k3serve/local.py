"""`k3serve run-local` (what `make run` starts): the platform as local processes on the CPU.

Generates the tiny K3-architecture model on first use (in $K3SERVE_HOME), then starts the
OpenAI-compatible server on 127.0.0.1 and prints its URL. The disaggregated pieces (router,
prefill/decode workers, Mooncake master) join this launcher as they land; today it runs the
colocated engine (`--role both`) behind the OpenAI API.
"""

from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the generated tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enable-prefix-caching", action="store_true", default=True)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")


def run(args: argparse.Namespace) -> int:
    from k3serve.workers.model.paths import ensure_tiny_model

    model = args.model or str(ensure_tiny_model())
    print(f"k3serve: model {model}", flush=True)
    from k3serve.workers import serve

    argv = [model, "--host", args.host, "--port", str(args.port), "--dtype", args.dtype]
    if args.enable_prefix_caching:
        argv.append("--enable-prefix-caching")
    p = argparse.ArgumentParser()
    serve.configure(p)
    sargs = p.parse_args(argv)
    print(f"k3serve: OpenAI-compatible API at http://{args.host}:{args.port}/v1  (Ctrl-C to stop)", flush=True)
    return serve.run(sargs)
