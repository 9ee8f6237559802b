"""`k3serve up` refusals that need no platform: a busy port, a directory that is not a checkpoint, `--store`;
the `run-local` alias; the router's own one-line refusals. (The running platform is tests/test_router_e2e.py.)"""

import os
import socket
import subprocess
import sys

ENV = dict(os.environ, PYTHONSAFEPATH="1")


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "k3serve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


def test_busy_port_is_one_line_and_exit_2(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        for cmd in ("up", "run-local"):
            r = _run(cmd, "--model", str(tiny_model_dir), "--port", str(port))
            assert r.returncode == 2, r.stderr
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and f"port {port}" in lines[0] and "--port" in lines[0], r.stderr
            assert "Traceback" not in r.stderr and "API is at" not in r.stdout


def test_not_a_checkpoint_and_store(tmp_path):
    r = _run("up", "--model", str(tmp_path), "--port", "0")
    assert r.returncode == 2 and "no config.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    if os.geteuid() != 0:  # --store needs a private network namespace
        r = _run("up", "--store", "--port", "0")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "needs root" in r.stderr
    else:  # as root --store runs for real (tests/test_up_store.py); its bad input is still one line
        r = _run("up", "--store", "--model", str(tmp_path), "--port", "0")
        assert r.returncode == 2 and "no config.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_router_refusals(tiny_model_dir, tmp_path):
    r = _run("router", "--workers", "127.0.0.1:1")
    assert r.returncode == 2 and "--model" in r.stderr
    r = _run("router", "--model", str(tiny_model_dir))
    assert r.returncode == 2 and "--workers" in r.stderr
    r = _run("router", "--model", str(tiny_model_dir), "--workers", "nohost")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    empty = tmp_path / "key"
    empty.write_text("  \n")
    r = _run("router", "--model", str(tiny_model_dir), "--workers", "127.0.0.1:1", "--api-key-file", str(empty),
             "--port", "0", "--metrics-port", "0")
    assert r.returncode == 2 and "empty" in r.stderr and "Traceback" not in r.stderr
