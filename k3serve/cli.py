"""The `k3serve` console script.

Each subcommand lives in its own module exposing `configure(parser)` and `run(args) -> int`.
Only the chosen subcommand's module is imported, so `k3serve make-model` never imports the HTTP,
gRPC or kopf stacks.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("k3serve.workers.model.make_model", "write a generated K3-architecture checkpoint"),
    "generate": ("k3serve.workers.generate_cli", "generate token ids offline (reference or engine)"),
    "serve": ("k3serve.workers.serve", "one-process OpenAI-compatible server"),
    "worker": ("k3serve.workers.worker", "engine behind the gRPC worker service"),
    "router": ("k3serve.router.main", "OpenAI-compatible gateway and router"),
    "operator": ("k3serve.operator.main", "the Kubernetes operator (run | render)"),
    "up": ("k3serve.up", "start the platform (workers + router) as local processes"),
    "run-local": ("k3serve.local", "alias of `k3serve up`"),
    "bench": ("k3serve.bench", "benchmark an OpenAI-compatible server (vllm bench serve style)"),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_mod, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        parser = _top_parser()
        args = parser.parse_args(argv)
        if args.version:
            from k3serve import __version__

            print(__version__)
            return 0
        parser.print_help()
        return 0 if not argv else 2
    name, rest = argv[0], argv[1:]
    try:
        module = importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        if e.name != COMMANDS[name][0]:
            raise
        print(f"k3serve {name}: not available in this version yet", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"k3serve {name}", description=COMMANDS[name][1])
    module.configure(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
