"""The images the operator renders (Dockerfile, Dockerfile.cuda), checked with a real Dockerfile parser.

No image can be built here (no container runtime, no registry): these tests parse both files with
`dockerfile-parse` and check what a build would produce against the repository itself: the user and
entrypoint the pod contract needs (docs/components.md), writable paths that are the pods' emptyDirs
(read-only root filesystem), the same install steps and pins as scripts/install.sh, the Mooncake
master on PATH, and COPY sources that exist and are not excluded by .dockerignore.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from k3serve.cli import COMMANDS
from k3serve.operator import names
from k3serve.operator.render import render
from k3serve.operator.render_context import DEFAULT_IMAGE, RenderOptions

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"cpu": ROOT / "Dockerfile", "cuda": ROOT / "Dockerfile.cuda"}
VENV = "/opt/k3serve"
# what scripts/install.sh installs for the tests only (not in the images)
TEST_ONLY = {"dockerfile-parse"}


def _parser(path: Path) -> DockerfileParser:
    # a file object: the parser takes a path not named "Dockerfile" for a directory
    return DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))


def _stages(path: Path) -> list[list[dict]]:
    parser = _parser(path)
    stages: list[list[dict]] = []
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            stages.append([])
        if stages and ins["instruction"] != "COMMENT":
            stages[-1].append(ins)
    return stages


def _args(path: Path) -> dict[str, str]:
    out = {}
    for ins in _parser(path).structure:
        if ins["instruction"] == "ARG" and "=" in ins["value"]:
            k, v = ins["value"].split("=", 1)
            out[k] = v
    return out


def _final_env(path: Path) -> dict[str, str]:
    return _parser(path).envs


def _pip_installs(shell: str) -> list[list[str]]:
    """Every `python -m pip install ...` of a shell text, as argv lists (after `install`)."""
    out = []
    for part in re.split(r"&&|\n", shell.replace("\\\n", " ")):
        words = shlex.split(part, comments=True)
        if "pip" in words and "install" in words and words[words.index("pip") - 1] == "-m":
            out.append(words[words.index("install") + 1 :])
    return out


def _docker_pip_installs(path: Path) -> list[list[str]]:
    build = _stages(path)[0]
    return [a for ins in build if ins["instruction"] == "RUN" for a in _pip_installs(ins["value"])]


def _without_index(argv: list[str]) -> list[str]:
    out, skip = [], False
    for w in argv:
        if skip:
            skip = False
            continue
        if w == "--index-url":
            skip = True
            continue
        out.append(w)
    return out


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            k, v = line.split("==", 1)
            pins[k.lower().replace("_", "-")] = v
    return pins


def _requirements(argv: list[str]) -> list[str]:
    return [w for w in argv if "==" in w]


@pytest.fixture(scope="module")
def tiny_objects() -> list[dict]:
    cr = yaml.safe_load((ROOT / "manifests/samples/tiny-cpu.yaml").read_text())
    cr["metadata"]["namespace"] = "demo"
    r = render(cr, RenderOptions())
    assert not r.problems, r.problems
    return r.objects


def _containers(objects: list[dict]) -> list[dict]:
    out = []
    for obj in objects:
        tpl = obj.get("spec", {}).get("template") or obj.get("spec", {}).get("leaderWorkerTemplate", {}).get(
            "workerTemplate"
        )
        if tpl:
            out += tpl["spec"]["containers"]
    return out


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_user_entrypoint_and_stages(kind):
    path = IMAGES[kind]
    stages = _stages(path)
    assert len(stages) == 2, "a build stage and a runtime stage"
    final = stages[-1]
    users = [i["value"] for i in final if i["instruction"] == "USER"]
    assert users == ["1000:1000"], users  # the pods' runAsUser/runAsGroup
    assert names.RUN_AS_USER == 1000
    (entry,) = [i["value"] for i in final if i["instruction"] == "ENTRYPOINT"]
    entry = json.loads(entry)  # exec form: containers set `args` only, which docker appends
    assert entry == [f"{VENV}/bin/k3serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["k3serve"] == "k3serve.cli:main"
    # the runtime stage takes the whole venv from the build stage, and the base images are the same
    copies = [i["value"] for i in final if i["instruction"] == "COPY"]
    assert f"--from=build {VENV} {VENV}" in copies
    froms = [s[0]["value"] for s in stages]
    assert froms == ["${PYTHON_IMAGE} AS build", "${PYTHON_IMAGE}"]
    py = _args(path)["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", py), py  # the Python the pins are tested on
    # the build proves both executables the operator renders exist
    build_runs = " ".join(i["value"] for i in stages[0] if i["instruction"] == "RUN")
    assert f"test -x {VENV}/bin/k3serve" in build_runs and f"test -x {VENV}/bin/mooncake_master" in build_runs


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_runs_with_read_only_root_filesystem(kind, tiny_objects):
    env = _final_env(IMAGES[kind])
    assert env["K3SERVE_HOME"] == names.CACHE_DIR
    assert env["PYTHONSAFEPATH"] == "1"  # operator/ must never shadow the stdlib module
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["PATH"].startswith(f"{VENV}/bin:")
    # every place the image tells a library to write is a writable mount of every rendered pod
    path_vars = [
        "HOME",
        "K3SERVE_HOME",
        "XDG_CACHE_HOME",
        "HF_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
    ]
    containers = _containers(tiny_objects)
    assert {c["name"] for c in containers} >= {"worker", "router", "mooncake-master"}
    for c in containers:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
        for var in path_vars:
            value = env[var]
            assert any(value == w or value.startswith(w.rstrip("/") + "/") for w in writable), (
                c["name"],
                var,
            )


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_rendered_containers_run_from_the_entrypoint(kind, tiny_objects):
    env = _final_env(IMAGES[kind])
    for c in _containers(tiny_objects):
        assert c["image"] == DEFAULT_IMAGE
        if "command" in c:  # the Mooncake master: resolved through PATH in the venv's bin
            assert c["command"] == ["mooncake_master"]
            assert env["PATH"].split(":")[0] == f"{VENV}/bin"
        else:
            assert c["args"][0] in COMMANDS, c["args"][:1]
    # pip puts mooncake_master into the venv's bin: it is a console script of the installed Mooncake wheel
    dist = importlib.metadata.distribution("mooncake-transfer-engine-non-cuda")
    assert "mooncake_master" in {e.name for e in dist.entry_points if e.group == "console_scripts"}


def test_cpu_install_steps_are_install_sh(tmp_path):
    """The CPU image installs exactly what `make install` (scripts/install.sh) installs, same order."""
    sh = (ROOT / "scripts/install.sh").read_text()
    want = []
    for argv in _pip_installs(sh):
        if set(_requirements(argv)) and all(r.split("==")[0] in TEST_ONLY for r in _requirements(argv)):
            continue
        argv = ['"."' if w in (".[test]",) else w for w in argv]
        argv = [w for w in argv if w != "-e"]
        want.append([w.strip('"') for w in argv])
    got = [[w.strip('"') for w in _without_index(a)] for a in _docker_pip_installs(IMAGES["cpu"])]
    want = [[w if w != ".[test]" else "." for w in a] for a in want]
    assert got == want
    assert any("torch==2.13.0" in a for a in got) and any("." in a for a in got)
    # the torch of the CPU image comes from the CPU wheel index
    assert _args(IMAGES["cpu"])["TORCH_INDEX_URL"].endswith("/whl/cpu")
    assert "libibverbs1" in (ROOT / "Dockerfile").read_text()


def test_cuda_install_steps_are_the_cuda_builds():
    got = _docker_pip_installs(IMAGES["cuda"])
    reqs = [r for argv in got for r in _requirements(argv)]
    pins = _constraints()
    by_name = {r.strip('"').split("==")[0].lower(): r.strip('"').split("==")[1] for r in reqs}
    for name in ("pip", "setuptools", "wheel", "torch", "nixl-cu12", "ray"):
        assert by_name[name] == (pins.get(name) or by_name[name]), name
    assert by_name["torch"] == pins["torch"]
    assert by_name["nixl-cu12"] == pins["nixl-cu12"]
    # the CUDA Mooncake build replaces the non-CUDA one, at the version the CPU install pins
    assert by_name["mooncake-transfer-engine"] == pins["mooncake-transfer-engine-non-cuda"]
    text = IMAGES["cuda"].read_text()
    assert "pip uninstall -q -y mooncake-transfer-engine-non-cuda" in text
    nixl = next(a for a in got if any("nixl-cu12" in w for w in a))
    assert "--no-deps" in nixl
    assert re.search(r"/whl/cu12\d$", _args(IMAGES["cuda"])["TORCH_INDEX_URL"])
    assert [a for a in got if '"."' in a or "." in a], "the project itself"


def _setup_components() -> list[str]:
    text = (ROOT / "setup.py").read_text()
    return json.loads(re.search(r"COMPONENTS = (\[.*?\])", text).group(1).replace("'", '"'))


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_copy_sources(kind):
    build = _stages(IMAGES[kind])[0]
    sources = []
    for ins in build:
        if ins["instruction"] == "COPY":
            words = ins["value"].split()
            sources += [w.rstrip("/") for w in words[:-1] if not w.startswith("--")]
    for src in sources:
        assert (ROOT / src).exists(), src
        for pat in _dockerignore():
            assert not fnmatch.fnmatch(src, pat.rstrip("/")), (src, pat)
    # every package setup.py maps, and every file the build backend reads
    assert set(sources) >= {"k3serve", *_setup_components()}
    assert set(sources) >= {"pyproject.toml", "setup.py", "constraints.txt", "README.md"}


def test_image_name_matches_the_operator_default():
    repo, tag = DEFAULT_IMAGE.rsplit(":", 1)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tag == version
    docs = (ROOT / "docs/kubernetes.md").read_text()
    assert f"docker build -t {repo}:{tag} ." in docs
    assert f"docker build -f Dockerfile.cuda -t {repo}:{tag}-cuda ." in docs
    assert f"docker push {repo}:{tag}" in docs


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root (a private mount namespace)")
def test_worker_runs_on_a_read_only_root_with_the_image_environment(tmp_path, tiny_model_dir):
    """What readOnlyRootFilesystem means for the image: in a private mount namespace this machine's root
    is bind-mounted read-only, /tmp and /var/cache (the pods' emptyDirs) are tmpfs, the checkpoint is a
    read-only mount, and `k3serve worker` runs there with the image's ENV (PATH pointing at this venv
    instead of /opt/k3serve): it loads, serves /health and generates with every other path read-only."""
    env = dict(_final_env(IMAGES["cpu"]))
    # the python base image's PATH follows ours (the parser expands the Dockerfile's $PATH to nothing)
    env["PATH"] = env["PATH"].replace(f"{VENV}/bin", str(Path(sys.executable).parent)).rstrip(":")
    env["PATH"] += ":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    env["K3SERVE_SERVED_MODEL_NAME"] = "k3-tiny"
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    port = _free_port()
    # the checkout and its venv stay visible (read-only) when they live under a tmpfs'd path (a CI clone in /tmp)
    hidden = {Path(p).resolve() for p in (Path(__file__).resolve().parents[1], sys.prefix, sys.base_prefix)}
    keep = "\n".join(f'mkdir -p "$R{q}" && mount --bind {q} "$R{q}" && mount -o remount,bind,ro "$R{q}"'
                     for q in (shlex.quote(str(h)) for h in sorted(hidden)
                               if any(h.is_relative_to(m) for m in ("/tmp", "/var/cache"))))
    script = f"""
set -e
R={shlex.quote(str(tmp_path / "root"))}
mkdir -p "$R"
mount --rbind / "$R"
mount -o remount,bind,ro "$R"
mount --bind {shlex.quote(str(tiny_model_dir))} "$R/srv"
mount -o remount,bind,ro "$R/srv"
mount -t tmpfs tmpfs "$R/tmp"
mount -t tmpfs tmpfs "$R/var/cache"
{keep}
if touch "$R/usr/k3serve-probe" 2>/dev/null; then echo "root is writable"; exit 3; fi
exec chroot "$R" /usr/bin/env -i {exports} sh -c 'mkdir -p /var/cache/k3serve && cd /var/cache/k3serve && \
  exec python -m k3serve.cli worker --model /srv --grpc-port 0 --metrics-port {port} --num-threads 1 \
  --max-model-len 256 --log-level warning'
"""
    proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, ready = [], None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and ready is None:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            ready = re.search(r"ready grpc=(\S+) metrics=(\S+) role=both model=k3-tiny", line)
        assert ready, "".join(lines)
        assert httpx.get(ready.group(2) + "/health", timeout=10).status_code == 200
        import grpc

        from k3serve.proto import worker_pb2 as pb
        from k3serve.proto import worker_pb2_grpc as pb_grpc
        from k3serve.proto.convert import sampling_to_proto

        with grpc.insecure_channel(ready.group(1)) as ch:
            resps = list(pb_grpc.WorkerStub(ch).Generate(pb.GenerateRequest(
                request_id="ro-1", prompt_token_ids=[5, 17, 42],
                sampling_params=sampling_to_proto(dict(temperature=0.0, max_tokens=3, ignore_eos=True))),
                timeout=60))
        assert sum(len(o.token_ids) for r in resps for o in r.outputs) == 3
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
