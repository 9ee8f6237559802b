"""`k3serve up` (what `make run` starts; `k3serve run-local` is the same command): the platform as local processes.

    k3serve up [--preset tiny | --model DIR] [--prefill N --decode M | --workers K] [--port 8000]

Starts the workers (`k3serve worker`), then the router (`k3serve router`) in front of them, every process
bound to 127.0.0.1, one log file per component in `--log-dir` (default `$K3SERVE_HOME/logs/up-<time>/`).
Writes `platform.json` there (pids, addresses, logs). Shows each component's progress while it starts, and prints the gateway URL and a curl example only once
a real request through the gateway has answered. A busy `--port` is refused with one line (exit 2) before
anything starts. Ctrl-C (or SIGTERM) stops everything and exits 0. A component that dies during start-up
ends the whole platform with exit 1 and the tail of its log.

Workers: `--prefill N --decode M` starts N prefill and M decode workers when this version's workers have
those roles; otherwise (the P/D roles not shipped yet) N + M colocated (`--role both`) workers, and says
so. `--workers K` asks for K colocated workers directly. `--store` (the Mooncake store) needs root (its
clients listen on all interfaces, so they must run in a private network namespace) and is refused
without it with one line. As root, `--store` starts `mooncake_master` and the workers inside one private
network namespace (kvstore/netns.py `PrivateNetns`; the workers get `--kv-store 127.0.0.1:PORT`); the
router stays in the host namespace and reaches the workers over Unix-domain sockets (`--grpc-uds`) in a
private directory, so nothing of the store is reachable from the host's network.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PROG = "k3serve up"


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=["tiny"], default=None, help="a generated model (default: tiny)")
    src.add_argument("--model", default=None, metavar="DIR", help="checkpoint directory")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default 1)")
    p.add_argument("--workers", type=int, default=None, metavar="K",
                   help="K colocated (--role both) workers instead of prefill/decode")
    p.add_argument("--store", action="store_true", help="start the Mooncake store (needs root)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the gateway")
    p.add_argument("--port", type=int, default=8000, help="the gateway's port (0 picks a free one)")
    p.add_argument("--policy", default="hybrid-prefix", help="routing policy (k3serve router --policy)")
    p.add_argument("--log-dir", default=None, help="where the per-component logs go")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default=None, help="engine dtype (k3serve worker --dtype)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key-file", default=None, metavar="PATH")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every worker (repeatable), e.g. --worker-arg=--prefix-match-unit=16")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the platform to be ready")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    ready: re.Match | None = None
    started: float = field(default_factory=time.monotonic)

    def start(self, env: dict) -> None:
        self.started = time.monotonic()
        f = open(self.log, "w", encoding="utf-8")  # noqa: SIM115 - the child keeps writing to it
        self.popen = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        f.close()

    def poll_ready(self, pattern: re.Pattern) -> bool:
        if self.ready is None:
            try:
                self.ready = pattern.search(self.log.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                return False
        return self.ready is not None

    def dead(self) -> bool:
        return self.popen is not None and self.popen.poll() is not None

    def tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("    " + s for s in lines[-n:])


def pd_roles_available() -> bool:
    """Whether this version's `k3serve worker` serves --role prefill/decode."""
    from k3serve.workers.worker import unsupported_layout

    ns = argparse.Namespace(role="prefill", tensor_parallel_size=1, data_parallel_size=1)
    return unsupported_layout(ns) is None


def _python() -> list[str]:
    return [sys.executable, "-m", "k3serve.cli"]


class Platform:
    """The started processes; `stop()` ends them all (SIGTERM, then SIGKILL after a grace period)."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def stop(self, grace: float = 10.0) -> None:
        for p in reversed(self.procs):
            if p.popen is not None and p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for p in self.procs:
            if p.popen is None:
                continue
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.popen.wait()


_WORKER_READY = re.compile(r"k3serve worker: ready grpc=(\S+)")
_WORKER_UDS = re.compile(r" uds=(unix:\S+)")
_ROUTER_READY = re.compile(r"k3serve router: listening on (http://\S+) metrics=(\S+)")


class Progress:
    def __init__(self, stream=sys.stdout):
        self.stream = stream
        self.tty = stream.isatty()

    def line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)


def _fail(msg: str, code: int = 2) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)
    return code


def _wait(procs: list[Proc], pattern: re.Pattern, deadline: float, progress: Progress, stopping) -> str | None:
    """Wait until every proc printed its ready line; None, or why not."""
    waiting = list(procs)
    while waiting:
        if stopping():
            return "interrupted"
        for p in list(waiting):
            if p.poll_ready(pattern):
                waiting.remove(p)
                progress.line(f"  ✓ {p.name:<10} ready in {time.monotonic() - p.started:5.1f}s  ({p.ready.group(1)})")
            elif p.dead():
                return f"{p.name} exited with status {p.popen.returncode} during start-up; its log ({p.log}):\n" \
                       f"{p.tail()}"
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in waiting)
            return f"{names} not ready after the --timeout; logs in {waiting[0].log.parent}"
        time.sleep(0.1)
    return None


def _wait_master(ns, port: int, master: Proc, deadline: float, progress: Progress, stopping) -> str | None:
    """Wait until the master inside `ns` accepts connections (probed from a thread moved into `ns`)."""
    import socket
    import threading

    def probe(out: list) -> None:
        ns.enter()  # this thread only
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                out.append(True)
        except OSError:
            pass

    while True:
        if stopping():
            return "interrupted"
        if master.dead():
            return f"mooncake-master exited with status {master.popen.returncode}:\n{master.tail()}"
        out: list = []
        t = threading.Thread(target=probe, args=(out,), daemon=True)
        t.start()
        t.join(2)
        if out:
            progress.line(f"{PROG}: mooncake-master ready (127.0.0.1:{port} inside the private namespace)")
            return None
        if time.monotonic() > deadline:
            return "mooncake-master did not start in time:\n" + master.tail()
        time.sleep(0.1)


def _probe(url: str, model: str, api_key: str | None, deadline: float, stopping) -> str | None:
    """One real chat request through the gateway (the platform answers); None, or why not."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    last = "no answer"
    while time.monotonic() < deadline and not stopping():
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)
            if r.status_code == 200:
                return None
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = str(e)
        time.sleep(0.3)
    return f"the gateway did not answer a request: {last}"


def _write_state(log_dir: Path, url: str, workers: list[Proc], roles: list[str], router: Proc,
                 master: Proc | None = None) -> None:
    """`platform.json` in the log directory: what runs where (pids, addresses, logs), for scripts and tests."""
    import json

    state = {"url": url, "router": {"pid": router.popen.pid, "metrics": router.ready.group(2), "log": str(router.log)},
             "workers": [{"name": w.name, "role": r, "pid": w.popen.pid, "grpc": w.ready.group(1), "log": str(w.log),
                          "cmd": w.cmd} for w, r in zip(workers, roles)]}
    if master is not None:  # --store: inside the private namespace, not reachable from the host
        state["store"] = {"pid": master.popen.pid, "log": str(master.log)}
    (log_dir / "platform.json").write_text(json.dumps(state, indent=2), encoding="utf-8")


def run(args: argparse.Namespace) -> int:
    from k3serve.common.ports import check_port_free

    if args.store and os.geteuid() != 0:
        return _fail("--store needs root: the Mooncake store's clients listen on all interfaces, so they run in a "
                     "private network namespace (unshare -n), which only root can create")
    for name in ("prefill", "decode", "workers"):
        v = getattr(args, name)
        if v is not None and v < 0:
            return _fail(f"--{name} must be >= 0")
    check_port_free(args.host, args.port, flag="--port", prog=PROG)

    if args.model:
        model = args.model
        if not os.path.isfile(os.path.join(model, "config.json")):
            return _fail(f"--model {model}: no config.json there (not a checkpoint directory)")
    else:
        from k3serve.workers.model.paths import default_serving_model, ensure_tiny_model

        print(f"{PROG}: preparing the model (generated on first use)...", flush=True)
        model = str(ensure_tiny_model() if args.preset == "tiny" else default_serving_model())
    name = args.served_model_name or os.path.basename(os.path.normpath(model))

    roles: list[str]
    if args.workers is not None:
        roles = ["both"] * args.workers
    elif pd_roles_available():
        roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    else:
        roles = ["both"] * (args.prefill + args.decode)
        print(f"{PROG}: this version's workers have no prefill/decode roles yet: starting {len(roles)} colocated "
              "(--role both) workers instead", flush=True)
    if not any(r in ("both", "decode") for r in roles):
        return _fail("at least one decode (or colocated) worker is needed")

    home = Path(os.environ.get("K3SERVE_HOME") or Path.home() / ".cache" / "k3serve")
    log_dir = Path(args.log_dir) if args.log_dir else home / "logs" / time.strftime("up-%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // len(roles))
    env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1")

    platform = Platform()
    stop = {"flag": False}
    ns = None
    sock_dir = None
    master = None
    store_port = 50051  # inside the private namespace every port is free

    def on_signal(_sig, _frm):
        stop["flag"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    progress = Progress()
    try:
        if args.store:
            import tempfile

            from k3serve.kvstore.master import master_args, master_binary
            from k3serve.kvstore.netns import NetnsError, PrivateNetns

            try:
                ns = PrivateNetns().start()
            except NetnsError as e:
                return _fail(f"--store: {e}")
            sock_dir = tempfile.mkdtemp(prefix="k3up-")  # short: a socket path must stay under 108 bytes
            master = Proc("mooncake-master", ns.argv([master_binary(), *master_args(
                "127.0.0.1", store_port, "127.0.0.1", store_port + 1)]), log_dir / "mooncake-master.log")
            master.start(env)
            platform.procs.append(master)
            why = _wait_master(ns, store_port, master, time.monotonic() + 30, progress, lambda: stop["flag"])
            if why:
                return 0 if why == "interrupted" else _fail(why, 1)
        counts: dict[str, int] = {}
        workers = []
        for role in roles:
            i = counts.get(role, 0)
            counts[role] = i + 1
            label = {"both": "worker"}.get(role, role) + f"-{i}"
            cmd = [*_python(), "worker", "--model", model, "--role", role, "--host", "127.0.0.1", "--grpc-port", "0",
                   "--metrics-port", "0", "--served-model-name", name, "--num-threads", str(threads),
                   "--log-level", "warning"]
            if args.prefix_caching:
                cmd.append("--enable-prefix-caching")
            if args.max_model_len:
                cmd += ["--max-model-len", str(args.max_model_len)]
            if args.dtype:
                cmd += ["--dtype", args.dtype]
            if ns is not None:
                if not args.prefix_caching:
                    return _fail("--store needs prefix caching (drop --no-prefix-caching)")
                cmd += ["--kv-store", f"127.0.0.1:{store_port}", "--grpc-uds", os.path.join(sock_dir, f"{label}.sock")]
                cmd = ns.argv(cmd)
            cmd += list(args.worker_arg)
            workers.append(Proc(label, cmd, log_dir / f"{label}.log"))
        progress.line(f"{PROG}: starting {len(workers)} worker(s) ({', '.join(sorted(set(roles)))}) on {model}; "
                      f"logs in {log_dir}")
        for w in workers:
            w.start(env)
            platform.procs.append(w)
        deadline = time.monotonic() + args.timeout
        why = _wait(workers, _WORKER_READY, deadline, progress, lambda: stop["flag"])
        if why:
            return 0 if why == "interrupted" else _fail(why, 1)

        addrs = {"both": [], "prefill": [], "decode": []}
        for w, role in zip(workers, roles):
            uds = _WORKER_UDS.search(w.ready.string[w.ready.start():].splitlines()[0]) if ns is not None else None
            addrs[role].append(uds.group(1) if uds else w.ready.group(1))
        rcmd = [*_python(), "router", "--model", model, "--host", args.host, "--port", str(args.port),
                "--metrics-port", "0", "--policy", args.policy, "--served-model-name", name,
                "--log-level", "warning"]
        for role, flag in (("both", "--workers"), ("prefill", "--prefill-workers"), ("decode", "--decode-workers")):
            if addrs[role]:
                rcmd += [flag, ",".join(addrs[role])]
        if args.api_key_file:
            rcmd += ["--api-key-file", args.api_key_file]
        router = Proc("router", rcmd, log_dir / "router.log")
        router.start(env)
        platform.procs.append(router)
        why = _wait([router], _ROUTER_READY, deadline, progress, lambda: stop["flag"])
        if why:
            return 0 if why == "interrupted" else _fail(why, 1)
        url = router.ready.group(1)
        _write_state(log_dir, url, workers, roles, router, master)
        api_key = None
        if args.api_key_file:
            with open(args.api_key_file, encoding="utf-8") as f:
                api_key = f.read().strip()
        why = _probe(url, name, api_key, deadline, lambda: stop["flag"] or router.dead())
        if why and not stop["flag"]:
            return _fail(why + (f"; router log:\n{router.tail()}" if router.dead() else ""), 1)
        if stop["flag"]:
            return 0
        auth = ' -H "Authorization: Bearer $KEY"' if api_key else ""
        print(f"\n{PROG}: the OpenAI-compatible API is at {url}/v1  (model {name!r}; Ctrl-C stops everything)\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
              f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
              f"\"max_tokens\": 32}}'\n", flush=True)
        reported: set[str] = set()
        while not stop["flag"]:
            for p in platform.procs:
                if p.dead() and p.name not in reported:
                    reported.add(p.name)
                    print(f"{PROG}: {p.name} exited with status {p.popen.returncode} (log {p.log})", flush=True)
            if router.dead():
                return _fail("the router exited; stopping", 1)
            time.sleep(0.2)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if platform.procs:
            print(f"{PROG}: stopping...", flush=True)
        platform.stop()
        if ns is not None:
            ns.stop()
        if sock_dir is not None:
            import shutil

            shutil.rmtree(sock_dir, ignore_errors=True)
