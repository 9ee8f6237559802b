"""`k3serve operator simulate -f CR.yaml`: run the pods a KimiK3Deployment renders as local processes.

Renders the CR (operator/render.py), plans every pod's process (operator/simulate_plan.py), starts them
all at once as the kubelet would, waits for every readiness probe, and prints the deployment's
`status.gatewayURL` with the local address it leads to:

    k3serve operator simulate: ready gatewayURL=http://tiny-router.default.svc.cluster.local:8000/v1 \
        -> http://127.0.0.1:PORT/v1 [prometheus=http://127.0.0.1:PORT]

With a Mooncake store (`spec.kvStore.enabled`) the pods run in a private network namespace (root
needed: Mooncake clients listen on every interface), like a pod network: the gateway (and Prometheus)
are reached through ports this process binds on 127.0.0.1 before it moves into the namespace, and
forwards. `--prometheus` starts a real Prometheus (/usr/bin/prometheus) scraping the PodMonitor's
targets. A pod whose process exits is restarted (restartPolicy Always, with the kubelet's back-off). Ctrl-C
(SIGINT/SIGTERM) stops every pod. Logs: ROOT/pods/POD/log, process ids: ROOT/pods/POD/pid.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import secrets as _secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from k3serve.operator import render_lws
from k3serve.operator.render import render
from k3serve.operator.render_context import RenderOptions
from k3serve.operator.simulate_operator import SimulatedCluster
from k3serve.operator.simulate_plan import IP_BASE, Inputs, SimPod, SimulateError, plan, prometheus_config
from k3serve.operator.status import gateway_url

PROMETHEUS = "/usr/bin/prometheus"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--filename", required=True, help="KimiK3Deployment YAML")
    p.add_argument("-n", "--namespace", default=None, help="namespace (default: the CR's, else default)")
    p.add_argument("--root", default=None, help="folder for the pods' sandboxes and logs (default: a temporary one)")
    p.add_argument("--pvc", action="append", default=[], metavar="CLAIM=DIR",
                   help="local directory of a PersistentVolumeClaim (default: a generated tiny model at the "
                        "claim's spec.model.pvc.path)")
    p.add_argument("--secret", action="append", default=[], metavar="NAME/KEY=VALUE",
                   help="a Secret key the pods read (default for the API key Secret: a random key, printed)")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="local address of the gateway")
    p.add_argument("--prometheus", action="store_true", help="also run Prometheus scraping the PodMonitor targets")
    p.add_argument("--prometheus-listen", default="127.0.0.1:0", metavar="HOST:PORT")
    p.add_argument("--scrape-interval", default=None, help="override spec.monitoring.interval (e.g. 1s)")
    p.add_argument("--private-network", choices=["auto", "yes", "no"], default="auto",
                   help="run the pods in a private network namespace (auto: when the store is enabled)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for every pod to be ready")
    p.add_argument("--exit-when-ready", action="store_true", help="stop the pods and exit 0 once all are ready")
    p.add_argument("--operator", action="store_true",
                   help="also run the operator (kopf) against an API emulator holding the CR; report its status")
    p.add_argument("--lws", action="store_true",
                   help="the cluster has the LeaderWorkerSet CRD: multi-node groups run as a LeaderWorkerSet's pods")


@dataclass
class Simulation:
    """The planned pods and, once started, their processes."""

    pods: list[SimPod]
    root: Path
    gateway_url: str  # status.gatewayURL as the operator reports it
    gateway_local: str = ""  # where it leads here
    prometheus_url: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    extra: list[subprocess.Popen] = field(default_factory=list)

    def materialize(self) -> None:
        for pod in self.pods:
            box = self.root / "pods" / pod.name
            for rel in pod.dirs:
                (box / rel).mkdir(parents=True, exist_ok=True)
            for rel, data in pod.files.items():
                (box / rel).parent.mkdir(parents=True, exist_ok=True)
                (box / rel).write_bytes(data)
            for rel, target in pod.links.items():
                (box / rel).parent.mkdir(parents=True, exist_ok=True)
                if not (box / rel).exists():
                    os.symlink(os.path.abspath(target), box / rel)

    def start(self) -> None:
        for pod in self.pods:
            self.start_pod(pod)

    def start_pod(self, pod: SimPod) -> None:
        """Start (or restart) one pod's container; its log appends, its pid is in ROOT/pods/POD/pid."""
        box = self.root / "pods" / pod.name
        tmp = box / "fs/tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONSAFEPATH": "1",
               "PYTHONUNBUFFERED": "1", "HOME": str(tmp), "TMPDIR": str(tmp)}
        env.update(pod.env)
        log = open(box / "log", "ab")  # noqa: SIM115 - closed with the process
        self.procs[pod.name] = subprocess.Popen(pod.argv, env=env, cwd=box, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        (box / "pid").write_text(str(self.procs[pod.name].pid))

    def restart_exited(self, backoff: dict[str, float], log=print) -> None:
        """restartPolicy Always: the kubelet restarts an exited container (back-off 1, 2, 4 ... 10 s). A
        LeaderWorkerSet pod's exit recreates its whole group (RecreateGroupOnPodRestart): the group's other
        pods are deleted (SIGTERM, SIGKILL after 15 s) and all of them start again together."""
        now = time.monotonic()
        for pod in self.pods:
            proc = self.procs[pod.name]
            if proc.poll() is None:
                continue
            due = backoff.setdefault(f"{pod.name}:due", now + backoff.get(f"{pod.name}:delay", 1.0))
            if now < due:
                continue
            self.restarts[pod.name] = self.restarts.get(pod.name, 0) + 1
            log(f"k3serve operator simulate: pod {pod.name} exited with code {proc.returncode}; restart "
                f"{self.restarts[pod.name]}", flush=True)
            backoff[f"{pod.name}:delay"] = min(2 * backoff.get(f"{pod.name}:delay", 1.0), 10.0)
            del backoff[f"{pod.name}:due"]
            for mate in self._recreate_group(pod, log):
                backoff.pop(f"{mate.name}:due", None)
                self.start_pod(mate)
            self.start_pod(pod)

    def _recreate_group(self, pod: SimPod, log) -> list[SimPod]:
        """The other pods of an exited LeaderWorkerSet pod's group, stopped (to be started with it)."""
        if not pod.workload.startswith(f"{render_lws.KIND}/"):
            return []
        group = pod.labels.get(render_lws.LABEL_GROUP_INDEX)
        mates = [p for p in self.pods if p.workload == pod.workload and p.name != pod.name
                 and p.labels.get(render_lws.LABEL_GROUP_INDEX) == group]
        log(f"k3serve operator simulate: recreating group {group} of {pod.workload} with "
            f"{', '.join(p.name for p in mates)}", flush=True)
        for p in mates:
            if self.procs[p.name].poll() is None:
                try:
                    os.killpg(self.procs[p.name].pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in mates:
            try:
                self.procs[p.name].wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.procs[p.name].pid, signal.SIGKILL)
                self.procs[p.name].wait()
        return mates

    def wait_ready(self, timeout: float, on_tick=None) -> None:
        deadline = time.monotonic() + timeout
        pending = {p.name: p for p in self.pods if p.ready_url}
        while pending:
            for name, pod in list(pending.items()):
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise SimulateError(f"pod {name} exited with code {proc.returncode} before it was ready:\n"
                                        + self.log_tail(name))
                try:
                    with urllib.request.urlopen(pod.ready_url, timeout=2) as r:
                        if r.status == 200:
                            del pending[name]
                except (urllib.error.URLError, OSError):
                    pass
            if on_tick is not None:
                on_tick()
            if pending and time.monotonic() > deadline:
                tails = "\n".join(self.log_tail(p) for p in sorted(pending))
                raise SimulateError(f"not ready after {timeout:.0f} s: {', '.join(sorted(pending))}\n{tails}")
            time.sleep(0.25)

    def wait_gateway(self, timeout: float) -> None:
        """Until every router counts all the workers it was given as healthy (its health checks run on
        their own interval, so a just-ready worker can still be unknown to it for a moment)."""
        import re

        deadline = time.monotonic() + timeout
        for router in (p for p in self.pods if p.component == "router"):
            argv = router.argv
            if "kubernetes" in argv:  # discovered from the API: every worker pod (single-node groups)
                want = sum(1 for p in self.pods if "grpc" in p.ports)
            else:
                want = sum(len(argv[i + 1].split(",")) for i, a in enumerate(argv)
                           if a in ("--workers", "--prefill-workers", "--decode-workers"))
            url = f"http://{router.ip}:{router.ports['metrics']}/metrics"
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=2) as r:
                        text = r.read().decode()
                    have = sum(float(v) for v in re.findall(r"^k3serve_router_workers\{[^}]*\} (\S+)$", text, re.M))
                    if have >= want:
                        break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise SimulateError(f"router {router.name} does not see its {want} workers as healthy:\n"
                                        + self.log_tail(router.name))
                time.sleep(0.2)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / "pods" / name / "log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return "\n".join(f"  [{name}] {line}" for line in text)

    def stop(self) -> None:
        procs = list(self.procs.values()) + self.extra
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def _parse_secret(items: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for item in items:
        ref, sep, value = item.partition("=")
        name, slash, key = ref.partition("/")
        if not (sep and slash and name and key):
            raise SimulateError(f"--secret {item!r}: expected NAME/KEY=VALUE")
        out.setdefault(name, {})[key] = value
    return out


def _parse_pvc(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        claim, sep, path = item.partition("=")
        if not (sep and claim and path):
            raise SimulateError(f"--pvc {item!r}: expected CLAIM=DIR")
        if not os.path.isdir(path):
            raise SimulateError(f"--pvc {item!r}: {path} is not a directory")
        out[claim] = path
    return out


def _default_claims(spec: dict, claims: dict[str, str], root: Path, log) -> None:
    """A claim not given with --pvc holds the generated tiny model at spec.model.pvc.path."""
    pvc = spec["model"].get("pvc")
    if not pvc or pvc["claimName"] in claims:
        return
    from k3serve.workers.model.paths import ensure_tiny_model

    tiny = ensure_tiny_model()
    claim_dir = root / "claims" / pvc["claimName"]
    target = claim_dir / pvc.get("path", "/").lstrip("/")
    if target != claim_dir:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.symlink(tiny, target)
    else:
        claim_dir.parent.mkdir(parents=True, exist_ok=True)
        if not claim_dir.exists():
            os.symlink(tiny, claim_dir)
    log(f"k3serve operator simulate: PersistentVolumeClaim {pvc['claimName']}: the generated tiny model "
        f"({tiny}) at {pvc.get('path', '/')}")
    claims[pvc["claimName"]] = str(claim_dir)


def free_ip_base(pods: int, ports: tuple[int, ...] = (8000, 9100, 50051)) -> ipaddress.IPv4Address:
    """A 127.100.N.1 block whose first `pods` addresses have the contract ports free (so simulations
    sharing this machine's network each get their own pod IPs)."""
    for n in range(os.getpid() % 200, os.getpid() % 200 + 250):
        base = ipaddress.IPv4Address(f"127.100.{n % 250 + 1}.1")
        if all(_port_free(str(base + i), port) for i in range(pods) for port in ports):
            return base
    raise SimulateError("no free 127.100.N.0/24 block for the pod addresses")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def build(cr: dict, *, root: Path, namespace: str | None = None, claims: dict[str, str] | None = None,
          secrets: dict[str, dict[str, str]] | None = None, log=print, ip_base=None,
          kubeconfig: str | None = None, lws: bool = False) -> Simulation:
    """Render `cr` and plan its pods (nothing started); `lws`: as for a cluster with the LWS CRD."""
    meta = cr.setdefault("metadata", {})
    meta["namespace"] = namespace or meta.get("namespace") or "default"
    options = RenderOptions(podmonitor=True, lws=lws)
    rendered = render(cr, options)
    if rendered.problems:
        raise SimulateError("the CR cannot be served:\n  " + "\n  ".join(rendered.problems))
    claims = dict(claims or {})
    secrets = {k: dict(v) for k, v in (secrets or {}).items()}
    _default_claims(rendered.spec, claims, root, log)
    ref = rendered.spec["router"].get("apiKeySecretRef")
    if ref:
        key = ref.get("key", "api-key")
        if key not in secrets.get(ref["name"], {}):
            secrets.setdefault(ref["name"], {})[key] = _secrets.token_hex(16)
            log(f"k3serve operator simulate: Secret {ref['name']}/{key} = {secrets[ref['name']][key]} "
                "(the API key clients send)")
    inputs = Inputs(namespace=meta["namespace"], cluster_domain=options.cluster_domain, secrets=secrets,
                    claims=claims)
    pods = plan(rendered.objects, inputs, root, ip_base or IP_BASE, kubeconfig)
    url = gateway_url(rendered, meta["name"], meta["namespace"], {}, options)
    sim = Simulation(pods=pods, root=root, gateway_url=url)
    sim.objects = rendered.objects  # type: ignore[attr-defined]
    sim.spec = rendered.spec  # type: ignore[attr-defined]
    sim.cr = cr  # type: ignore[attr-defined]
    sim.config_hash = rendered.config_hash  # type: ignore[attr-defined]
    sim.secrets = secrets  # type: ignore[attr-defined]  (with any generated API key)
    return sim


def router_address(sim: Simulation) -> tuple[str, int]:
    router = next(p for p in sim.pods if p.component == "router")
    return router.ip, router.ports["http"]


# --- a private network namespace, reached through forwarded ports --------------------------------------


def _bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host or "127.0.0.1", int(port)))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _enter_private_netns() -> None:
    import ctypes

    if os.geteuid() != 0:
        raise SimulateError("a private network namespace needs root (Mooncake clients listen on every "
                            "interface); run as root or pass --private-network no")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        raise SimulateError(f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}")
    r = subprocess.run(["ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SimulateError(f"ip link set lo up failed: {r.stderr.strip()}")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001 - closing a broken socket
            pass


def _forward_forever(pairs: list[tuple[socket.socket, tuple[str, int]]]) -> threading.Thread:
    """Accept on each bound socket (made before the move), connect inside the namespace, copy bytes."""

    def handler_for(target):
        async def handle(r, w):
            try:
                tr, tw = await asyncio.open_connection(*target)
            except OSError:
                w.close()
                return
            await asyncio.gather(_pipe(r, tw), _pipe(tr, w))

        return handle

    async def main():
        for sock, target in pairs:
            await asyncio.start_server(handler_for(target), sock=sock)
        await asyncio.Event().wait()

    t = threading.Thread(target=lambda: asyncio.run(main()), daemon=True, name="simulate-forward")
    t.start()
    return t


def start_prometheus(sim: Simulation, listen: str, interval: str | None,
                     operator_targets: list[dict] | None = None) -> subprocess.Popen:
    cfg = sim.root / "prometheus.yml"
    cfg.write_text(prometheus_config(sim.objects, sim.pods, sim.pods[0].env.get("K3SERVE_NAMESPACE", "default"),
                                     interval, operator_targets))
    data = sim.root / "prometheus-data"
    data.mkdir(exist_ok=True)
    log = open(sim.root / "prometheus.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={data}",
                             f"--web.listen-address={listen}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    # ready once every target has been scraped: counters then have a sample from before any traffic
    want = sum(len(job["static_configs"]) for job in json.loads(cfg.read_text())["scrape_configs"])
    query = urllib.parse.urlencode({"query": "count(up == 1)"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SimulateError("prometheus exited:\n" + (sim.root / "prometheus.log").read_text()[-2000:])
        try:
            with urllib.request.urlopen(f"http://{listen}/api/v1/query?{query}", timeout=2) as r:
                result = json.loads(r.read())["data"]["result"]
                if result and int(float(result[0]["value"][1])) >= want:
                    return proc
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise SimulateError(f"prometheus has not scraped all {want} targets after 60 s")


def run(args: argparse.Namespace) -> int:
    try:
        with open(args.filename) as f:
            cr = yaml.safe_load(f)
        if not isinstance(cr, dict):
            raise SimulateError(f"{args.filename}: not a KimiK3Deployment")
        root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="k3serve-simulate-"))
        root.mkdir(parents=True, exist_ok=True)
        kubeconfig = str(root / "kubeconfig") if args.operator else None
        sim = build(cr, root=root, namespace=args.namespace, claims=_parse_pvc(args.pvc),
                    secrets=_parse_secret(args.secret), kubeconfig=kubeconfig, lws=args.lws)
    except (OSError, yaml.YAMLError, SimulateError) as e:
        print(f"k3serve operator simulate: {e}", file=sys.stderr)
        return 2
    if args.prometheus and not (shutil.which(PROMETHEUS) or os.path.exists(PROMETHEUS)):
        print(f"k3serve operator simulate: --prometheus needs {PROMETHEUS} (Debian package prometheus)",
              file=sys.stderr)
        return 2
    private = args.private_network == "yes" or (args.private_network == "auto" and sim.spec["kvStore"]["enabled"])
    if not private:  # this machine's loopback is shared: take pod addresses nothing else listens on
        try:
            sim = build(cr, root=root, namespace=args.namespace, claims=_parse_pvc(args.pvc),
                        secrets=sim.secrets, log=lambda *_a, **_k: None,
                        ip_base=free_ip_base(len(sim.pods)), kubeconfig=kubeconfig, lws=args.lws)
        except SimulateError as e:
            print(f"k3serve operator simulate: {e}", file=sys.stderr)
            return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    cluster = None
    cleanup: list = []
    try:
        gateway_sock = _bind(args.listen) if private else None
        prom_sock = _bind(args.prometheus_listen) if (private and args.prometheus) else None
        if private:
            _enter_private_netns()
        if args.operator:  # the API emulator and the operator first: the router discovers pods there
            cluster = SimulatedCluster(sim.cr, sim.pods, root, lws=args.lws)
            cleanup.append(cluster.stop)
            cluster.start()
        sim.materialize()
        sim.start()
        sim.wait_ready(args.timeout, on_tick=cluster.sync if cluster else None)
        sim.wait_gateway(60)
        if cluster is not None:  # the operator's own status: phase Ready and status.gatewayURL
            status = cluster.wait_ready(args.timeout)
            if status.get("configHash") != sim.config_hash:
                raise SimulateError(f"the operator's configHash {status.get('configHash')} is not the simulated "
                                    f"pods' {sim.config_hash}")
            sim.gateway_url = status["gatewayURL"]
            print(f"k3serve operator simulate: operator status phase={status['phase']} "
                  f"readyPools={status.get('readyPools')} configHash={status['configHash']}", flush=True)
        rip, rport = router_address(sim)
        if args.prometheus:
            prom_listen = "127.0.0.1:9090" if private else _free_listen(args.prometheus_listen)
            sim.extra.append(start_prometheus(sim, prom_listen, args.scrape_interval,
                                              cluster.prometheus_targets() if cluster else None))
            sim.prometheus_url = f"http://{prom_listen}"
        if private:
            pairs = [(gateway_sock, (rip, rport))]
            if prom_sock is not None:
                pairs.append((prom_sock, ("127.0.0.1", 9090)))
                sim.prometheus_url = _url(prom_sock)
            _forward_forever(pairs)
            sim.gateway_local = _url(gateway_sock) + "/v1"
        else:
            sim.gateway_local = f"http://{rip}:{rport}/v1"
        extra = f" prometheus={sim.prometheus_url}" if sim.prometheus_url else ""
        print(f"k3serve operator simulate: ready gatewayURL={sim.gateway_url} -> {sim.gateway_local}{extra} "
              f"pods={len(sim.pods)} root={root}", flush=True)
        for p in sim.pods:
            print(f"  pod {p.name} ip={p.ip} log={root / 'pods' / p.name / 'log'}", flush=True)
        backoff: dict[str, float] = {}
        last_sync = 0.0
        while not args.exit_when_ready and not stop.is_set():
            sim.restart_exited(backoff)
            if cluster is not None and time.monotonic() - last_sync > 1.0:
                cluster.sync()
                last_sync = time.monotonic()
            stop.wait(0.2)
        return 0
    except SimulateError as e:
        print(f"k3serve operator simulate: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        sim.stop()
        for fn in cleanup:
            fn()


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


def _free_listen(listen: str) -> str:
    host, _, port = listen.rpartition(":")
    if port != "0":
        return listen
    with socket.socket() as s:
        s.bind((host or "127.0.0.1", 0))
        return f"{host or '127.0.0.1'}:{s.getsockname()[1]}"


__all__ = ["Simulation", "SimulateError", "build", "configure", "run"]
