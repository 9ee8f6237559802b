"""`k3serve operator`: run the kopf operator, render a CR offline, or regenerate the YAML artifacts.

k3serve operator run [-A | -n NS ...] [--liveness URL] [--metrics-host H --metrics-port P]
k3serve operator render -f CR.yaml [-n NS] [--lws] [--no-podmonitor]   # like `helm template`
k3serve operator generate [--check]                                  # CRD, dashboards, RBAC files
k3serve operator simulate -f CR.yaml [--prometheus] [--lws]          # the rendered pods as local processes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from k3serve.operator.render_context import DEFAULT_IMAGE


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = sub.add_parser("run", help="run the operator (kopf) against the current cluster")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    scope.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch this namespace (repeatable)"
    )
    run.add_argument(
        "--liveness", default="", help="kopf liveness endpoint, e.g. http://127.0.0.1:8080/healthz"
    )
    run.add_argument("--metrics-host", default="127.0.0.1", help="address of the /metrics endpoint")
    run.add_argument("--metrics-port", type=int, default=9100, help="port of /metrics (0: off)")
    run.add_argument("--status-interval", type=float, default=10.0, help="seconds between status refreshes")
    run.add_argument(
        "--resync-interval",
        type=float,
        default=60.0,
        help="seconds between full reconciles (drift repair of every child)",
    )
    run.add_argument("--default-image", default=DEFAULT_IMAGE, help="image for CRs without spec.image")
    run.add_argument("--cluster-domain", default="cluster.local")
    run.add_argument("-v", "--verbose", action="store_true")

    render = sub.add_parser("render", help="print the objects a KimiK3Deployment renders to (no cluster)")
    render.add_argument("-f", "--filename", required=True, help="CR YAML file ('-' for stdin)")
    render.add_argument(
        "-n", "--namespace", default="", help="namespace when the CR names none (default: default)"
    )
    render.add_argument("--lws", action="store_true", help="render multi-node groups as LeaderWorkerSets")
    render.add_argument("--no-podmonitor", action="store_true", help="the cluster lacks the PodMonitor CRD")
    render.add_argument("--default-image", default=DEFAULT_IMAGE)
    render.add_argument("--cluster-domain", default="cluster.local")
    render.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")

    from k3serve.operator import simulate

    simulate.configure(sub.add_parser("simulate", help="run the pods a CR renders as local processes (no cluster)"))

    gen = sub.add_parser("generate", help="write the generated CRD, dashboards and RBAC files into the repo")
    gen.add_argument("--root", default="", help="repository root (default: the checkout this module is in)")
    gen.add_argument("--check", action="store_true", help="only report files that differ (exit 1 if any)")


def run(args: argparse.Namespace) -> int:
    if args.action == "simulate":
        from k3serve.operator import simulate

        return simulate.run(args)
    return {"run": _run, "render": _render, "generate": _generate}[args.action](args)


def _run(args: argparse.Namespace) -> int:
    os.environ["K3SERVE_OPERATOR_STATUS_INTERVAL"] = str(args.status_interval)
    os.environ["K3SERVE_OPERATOR_RESYNC_INTERVAL"] = str(args.resync_interval)
    os.environ["K3SERVE_OPERATOR_DEFAULT_IMAGE"] = args.default_image
    os.environ["K3SERVE_OPERATOR_CLUSTER_DOMAIN"] = args.cluster_domain
    import kopf

    from k3serve.operator import handlers

    kopf.configure(
        verbose=args.verbose, log_format=kopf.LogFormat.FULL if args.verbose else kopf.LogFormat.PLAIN
    )
    if not args.verbose:
        handlers.quiet_timer_logs()
    if args.metrics_port:
        from k3serve.common.ports import exit_on_bind_error

        with exit_on_bind_error(args.metrics_host, args.metrics_port, flag="--metrics-port",
                                prog="k3serve operator"):
            handlers.METRICS.serve(args.metrics_host, args.metrics_port)
    kopf.run(
        standalone=True,
        clusterwide=args.all_namespaces or not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
    )
    return 0


def _render(args: argparse.Namespace) -> int:
    import yaml

    from k3serve.operator import crd
    from k3serve.operator.render import render
    from k3serve.operator.render_context import RenderOptions

    if args.filename == "-":
        text = sys.stdin.read()
    else:
        with open(args.filename, encoding="utf-8") as f:
            text = f.read()
    options = RenderOptions(
        lws=args.lws,
        podmonitor=not args.no_podmonitor,
        default_image=args.default_image,
        cluster_domain=args.cluster_domain,
    )
    objects, failed = [], False
    for doc in yaml.safe_load_all(text):
        if not doc or doc.get("kind") != crd.KIND:
            continue
        doc.setdefault("metadata", {})
        doc["metadata"].setdefault("namespace", args.namespace or "default")
        result = render(doc, options)
        for problem in result.problems:
            print(f"{doc['metadata'].get('name')}: {problem}", file=sys.stderr)
        for note in result.notes:
            print(f"{doc['metadata'].get('name')}: note: {note}", file=sys.stderr)
        failed = failed or bool(result.problems)
        objects += result.objects
    if args.output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        print(yaml.safe_dump_all(objects, sort_keys=False), end="")
    return 1 if failed else 0


def _generate(args: argparse.Namespace) -> int:
    from k3serve.operator import generate

    root = args.root or generate.repo_root()
    differ = generate.write(root, check=args.check)
    for path in differ:
        print(("differs: " if args.check else "wrote: ") + path)
    return 1 if (args.check and differ) else 0
