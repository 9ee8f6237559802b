"""`k3serve operator simulate` as a subprocess for the tests: start a sample CR's pods, read the gateway
(and Prometheus) address it prints, stop it with SIGTERM at the end of the session.

`shared_simulation(request, key, make_cr)` starts one simulation per key and test module, for all the
tests of that module.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready gatewayURL=(\S+) -> (\S+)(?: prometheus=(\S+))?")


@dataclass
class RunningSim:
    proc: subprocess.Popen
    status_gateway: str  # status.gatewayURL as the operator reports it
    gateway: str  # the local URL it leads to (.../v1)
    prometheus: str | None
    root: Path
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)

    def log(self, pod: str) -> str:
        path = self.root / "pods" / pod / "log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def sample(name: str = "tiny-cpu.yaml") -> dict:
    return yaml.safe_load((ROOT / "manifests/samples" / name).read_text())


def start_simulation(cr: dict, root: Path, *, model_dir: Path, prometheus: bool = False, operator: bool = True,
                     scrape_interval: str = "1s", timeout: float = 400, extra_args: list[str] = ()) -> RunningSim:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cr.yaml").write_text(yaml.safe_dump(cr))
    cmd = [sys.executable, "-m", "k3serve.cli", "operator", "simulate", "-f", str(root / "cr.yaml"),
           "--root", str(root / "sim"), "--timeout", str(timeout)]
    pvc = (cr["spec"]["model"].get("pvc") or {})
    if pvc:  # the claim holds the session's tiny checkpoint at spec.model.pvc.path
        claim = root / "claim"
        target = claim / pvc.get("path", "/").lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            os.symlink(model_dir, target)
        cmd += ["--pvc", f"{pvc['claimName']}={claim}"]
    if prometheus:
        cmd += ["--prometheus", "--scrape-interval", scrape_interval]
    if operator:  # the real operator reconciles the CR (API emulator) and reports the gateway URL
        cmd += ["--operator"]
    cmd += list(extra_args)
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    deadline = time.monotonic() + timeout + 30
    found = None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        found = READY.search(line)
        if found:
            break
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError("simulate did not get ready:\n" + "".join(lines) + (proc.stdout.read() or ""))

    def drain():
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    return RunningSim(proc, found.group(1), found.group(2), found.group(3), root / "sim", lines)


_SIMS: dict[tuple[str, str], RunningSim] = {}


def shared_simulation(request, key: str, make_cr, model_dir: Path, **kw) -> RunningSim:
    """One simulation per key and test module, stopped (its exit code checked) when the module ends,
    so no pods outlive the tests that drive them."""
    import pytest

    module = request.node.getparent(pytest.Module)
    ident = (module.nodeid, key)
    if ident not in _SIMS:
        root = request.config._tmp_path_factory.mktemp(f"sim-{key}")
        sim = start_simulation(make_cr(), root, model_dir=model_dir, **kw)
        _SIMS[ident] = sim

        module.addfinalizer(lambda: release(request, key))
    return _SIMS[ident]


def release(request, key: str) -> None:
    """Stop a module's simulation now (if it runs) and check that simulate exited 0."""
    import pytest

    sim = _SIMS.pop((request.node.getparent(pytest.Module).nodeid, key), None)
    if sim is not None:
        code = sim.stop()
        assert code == 0, f"simulate exited with {code}:\n{sim.output()[-4000:]}"
