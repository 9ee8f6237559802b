"""Every code block of README.md and docs/*.md runs in a test, or is validated where it cannot run here.

Blocks are found generically (every ``` fence of every Markdown file there, so a new document is covered
with no edit here) and handled by kind:

* ```python: run in a fresh interpreter (K3SERVE_HOME = the test session's, so `ensure_tiny_model()`
  finds the tiny model). A block that talks to `http://127.0.0.1:8000` gets a `k3serve serve` of the
  tiny model started for it, with that address rewritten to the server's real one.
* command blocks (```bash/```sh/```console, or an unlabeled/```text block whose lines are commands):
  every command is checked by its program (VALIDATORS): `k3serve` command lines are parsed by the
  subcommand's own argument parser (synopses with placeholders: every flag must exist), `make`
  targets must exist, `helm install` is rendered with `helm template` and `kubectl apply -k` with
  `kubectl kustomize` (both in .tools/), files named by `-f` must exist, `mooncake_master` flags must
  exist in the binary, scripts and test paths must exist. An unknown program fails the test: add a
  validator here, or mark the block.
* other unlabeled/```text blocks (formats, diagrams, output samples) are not code.

Marking a block that cannot run here: put `<!-- docs-test: not-runnable-here: REASON -->` on the line
before its fence (a cluster, a GPU, root, a long-running server...). A marked Python block is still
compiled and a marked command block still goes through `bash -n`; the reason must not be empty.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / ".tools"
MARK_RE = re.compile(r"<!--\s*docs-test:\s*not-runnable-here:\s*(.*?)\s*-->")
FENCE_RE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
COMMAND_LANGS = {"bash", "sh", "shell", "console"}
LOCAL_URL = "http://127.0.0.1:8000"


@dataclass
class Block:
    doc: str  # path relative to the repo
    line: int
    lang: str
    text: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def extract(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE_RE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK_RE.search(before)
        out.append(Block(str(path.relative_to(ROOT)), line, m.group(1).lower(), m.group(2), mark.group(1) if mark else None))
    return out


BLOCKS = [b for p in doc_files() for b in extract(p)]


# --- command lines --------------------------------------------------------------------------------

def commands(text: str) -> list[str]:
    """The block's commands: comments dropped, `\\` continuations joined, a leading `$ ` removed."""
    out, cur = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not cur and (not line or line.startswith("#")):
            continue
        line = re.sub(r"\s+#\s.*$", "", line)  # trailing comment
        line = line.removeprefix("$ ")
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def _looks_like_command(line: str) -> bool:
    words = line.split()
    return bool(words) and (words[0] in VALIDATORS or (re.fullmatch(r"[a-z][\w.-]*", words[0]) is not None
                                                       and len(words) > 1 and words[1].startswith("-")))


def is_command_block(b: Block) -> bool:
    if b.lang in COMMAND_LANGS:
        return True
    if b.lang not in ("", "text"):
        return False
    cmds = commands(b.text)
    return bool(cmds) and all(_looks_like_command(c) for c in cmds)


PLACEHOLDER_RE = re.compile(r"\b[A-Z][A-Z0-9_]{1,}\b|[|\[\]]|<[^>]+>|\.\.\.")


def _words(cmd: str) -> list[str]:
    cmd = re.sub(r"\$\((K3SERVE_POD_IP|POD_IP)\)", "10.0.0.1", cmd)
    cmd = re.sub(r"\$\(([^)]*)\)", "x", cmd)  # other command substitutions: a plain word
    return shlex.split(cmd)


def _flags(words: list[str]) -> list[str]:
    out = []
    for w in words:
        w = w.strip("[]")
        for alt in w.split("|"):
            if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", alt):
                out.append(alt.split("=", 1)[0])
    return out


def _subparser(words: list[str]):
    """The argparse parser of a `k3serve` subcommand (and the remaining words), as k3serve.cli builds it."""
    import argparse
    import importlib

    from k3serve import cli

    name = words[1]
    assert name in cli.COMMANDS, f"k3serve has no subcommand {name!r}"
    parser = argparse.ArgumentParser(prog=f"k3serve {name}", exit_on_error=False)
    importlib.import_module(cli.COMMANDS[name][0]).configure(parser)
    return parser, words[2:]


def _all_options(parser) -> set[str]:
    import argparse

    opts = set()
    for a in parser._actions:
        opts |= set(a.option_strings)
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                opts |= _all_options(sub)
    return opts


def check_k3serve(cmd: str) -> None:
    words = _words(cmd)
    parser, rest = _subparser(words)
    if PLACEHOLDER_RE.search(" ".join(rest)):  # a synopsis: every flag it names must exist
        unknown = [f for f in _flags(rest) if f not in _all_options(parser)]
        assert not unknown, f"`{cmd}`: {unknown} are not options of k3serve {words[1]}"
    else:
        parser.parse_args(rest)  # a concrete command line parses (argparse.ArgumentError otherwise)


def check_make(cmd: str) -> None:
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))
    for t in _words(cmd)[1:]:
        assert t in targets, f"`{cmd}`: no make target {t!r}"


def _tool(name: str) -> str:
    path = TOOLS / name
    assert path.exists(), f"{path} missing (scripts/install.sh puts helm and kubectl there)"
    return str(path)


def _files_after(words: list[str], flag: str) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == flag]


def check_kubectl(cmd: str) -> None:
    words = _words(cmd)
    for f in _files_after(words, "-f"):
        assert (ROOT / f).is_file(), f"`{cmd}`: no file {f}"
        assert all(d and d.get("kind") for d in yaml.safe_load_all((ROOT / f).read_text())), f
    for d in _files_after(words, "-k"):
        r = subprocess.run([_tool("kubectl"), "kustomize", str(ROOT / d)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "kind:" in r.stdout, f"`{cmd}`: kubectl kustomize failed: {r.stderr}"
    # everything else (get, describe, scale, create ...) needs a cluster: docs/kubernetes.md's CR tests


def check_helm(cmd: str) -> None:
    words = _words(cmd)
    assert words[1] in ("install", "upgrade", "template"), f"`{cmd}`: no validator for helm {words[1]}"
    rest = [w for w in words[2:] if w not in ("--create-namespace", "--wait", "--install")]
    r = subprocess.run([_tool("helm"), "template", *rest], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "kind:" in r.stdout, f"`{cmd}`: helm template failed: {r.stderr}"


def check_docker(cmd: str) -> None:
    words = _words(cmd)
    if words[1] == "build":
        dockerfile = (_files_after(words, "-f") or ["Dockerfile"])[0]
        assert (ROOT / dockerfile).is_file(), f"`{cmd}`: no {dockerfile}"
        assert (ROOT / words[-1]).is_dir(), f"`{cmd}`: no build context {words[-1]}"
    else:
        assert words[1] in ("push", "pull", "tag"), f"`{cmd}`: no validator for docker {words[1]}"


def check_mooncake_master(cmd: str) -> None:
    binary = Path(sys.executable).parent / "mooncake_master"
    assert binary.exists(), "mooncake_master is installed into the venv by scripts/install.sh"
    helpfull = subprocess.run([str(binary), "--helpfull"], capture_output=True, text=True, timeout=30)
    known = set(re.findall(r"^\s+-(\w+) \(", helpfull.stdout + helpfull.stderr, re.M))
    unknown = [f for f in _flags(_words(cmd)[1:]) if f.lstrip("-") not in known]
    assert not unknown, f"`{cmd}`: mooncake_master has no flags {unknown}"


def check_python(cmd: str) -> None:
    words = _words(cmd)[1:]
    if words[:2] == ["-m", "pip"]:
        return  # installs (the device-machine recipe): syntax only
    if words[:2] == ["-m", "pytest"]:
        for p in (w for w in words[2:] if not w.startswith("-") and "/" in w):
            assert (ROOT / p).exists(), f"`{cmd}`: no test path {p}"
        return
    assert words and (ROOT / words[0]).is_file(), f"`{cmd}`: no script {words[0]}"


def check_export(cmd: str) -> None:
    pass  # environment only; bash -n checks the syntax


VALIDATORS = {"k3serve": check_k3serve, "make": check_make, "kubectl": check_kubectl, "helm": check_helm,
              "docker": check_docker, "mooncake_master": check_mooncake_master, "python": check_python,
              "python3": check_python, "export": check_export}


# --- the tests ------------------------------------------------------------------------------------

CODE = [b for b in BLOCKS if b.lang == "python"]
CMDS = [b for b in BLOCKS if b.lang != "python" and is_command_block(b)]


def test_the_extractor_finds_the_blocks():
    docs = {b.doc for b in BLOCKS}
    assert {"README.md", "docs/serving.md", "docs/components.md", "docs/kubernetes.md"} <= docs
    assert any(b.doc == "README.md" for b in CODE) and any(b.doc == "README.md" for b in CMDS)
    for b in BLOCKS:
        assert b.skip_reason is None or b.skip_reason.strip(), f"{b.id}: a not-runnable-here mark needs a reason"
    unknown_langs = {b.lang for b in BLOCKS} - {"python", "", "text", "yaml", "json", "toml", *COMMAND_LANGS}
    assert not unknown_langs, f"code blocks in languages this test cannot run or validate: {unknown_langs}"


def test_the_readme_lists_every_doc():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name})" not in readme]
    assert not missing, f"README.md does not link {missing}"


@pytest.mark.parametrize("block", CMDS, ids=[b.id for b in CMDS])
def test_command_block(block):
    r = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=10)
    assert r.returncode == 0, f"{block.id}: not valid shell: {r.stderr}"
    if block.skip_reason:
        return
    for cmd in commands(block.text):
        program = _words(cmd)[0]
        assert program in VALIDATORS, (f"{block.id}: no validator for `{program}` (add one to tests/test_docs.py "
                                       "or mark the block not-runnable-here with a reason)")
        VALIDATORS[program](cmd)


@pytest.fixture(scope="module")
def local_server(tiny_model_dir, tmp_path_factory):
    """`k3serve serve` of the tiny model for snippets that use the local URL of `make run`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("docs") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "k3serve.cli", "serve", str(tiny_model_dir), "--port",
                                 str(port), "--max-model-len", "512", "--num-threads", "1", "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONSAFEPATH="1"))
    deadline = time.monotonic() + 180
    while "listening on" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.mark.parametrize("block", CODE, ids=[b.id for b in CODE])
def test_python_block(block, tiny_model_dir, request, tmp_path):
    ast.parse(block.text, filename=block.id)
    if block.skip_reason:
        return
    code = block.text
    if LOCAL_URL in code:
        code = code.replace(LOCAL_URL, request.getfixturevalue("local_server"))
    env = dict(os.environ, PYTHONSAFEPATH="1", K3SERVE_HOME=os.environ["K3SERVE_HOME"])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, f"{block.id} failed:\n{block.text}\n--- stderr ---\n{r.stderr[-3000:]}"


def test_data_blocks_parse():
    """```yaml / ```json blocks are data: each must parse."""
    import json

    for block in (b for b in BLOCKS if b.lang in ("yaml", "json")):
        try:
            json.loads(block.text) if block.lang == "json" else list(yaml.safe_load_all(block.text))
        except ValueError as e:
            raise AssertionError(f"{block.id}: {e}") from None
