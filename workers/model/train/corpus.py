"""The demo model's training text: the Python standard library's own sources, split by file.

    files = stdlib_files()                     # [(relative path, text)], sorted, site-packages excluded
    train, valid, heldout = split_files(files)  # ~3% held out, ~2% validation, by a hash of the path
    funcs = extract_functions(text)            # short functions with their header and docstring

The split depends only on each file's path (crc32 of the relative path), so it is the same on every
machine whatever the file order, and a file is in exactly one part. The validation files pick the
pretraining snapshot (lowest validation loss); the held-out files are only read by the final evaluation.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass

HELDOUT_PER_MILLE = 30
VALID_PER_MILLE = 20
MAX_FILE_BYTES = 400_000
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[tuple[str, str]]:
    """Every UTF-8 `*.py` file under the standard library directory (up to MAX_FILE_BYTES), sorted by path."""
    root = root or stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            if os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                out.append((os.path.relpath(path, root), text))
    return sorted(out)


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % 1000 < HELDOUT_PER_MILLE


def is_validation(relpath: str) -> bool:
    return HELDOUT_PER_MILLE <= zlib.crc32(relpath.encode()) % 1000 < HELDOUT_PER_MILLE + VALID_PER_MILLE


def split_files(files: list[tuple[str, str]]):
    """(train, validation, held-out) lists of (relative path, text)."""
    held = [f for f in files if is_heldout(f[0])]
    valid = [f for f in files if is_validation(f[0])]
    train = [f for f in files if not is_heldout(f[0]) and not is_validation(f[0])]
    return train, valid, held


@dataclass
class Function:
    name: str
    args: list[str]
    header: str  # the def line(s) as in the file (original indentation), ending in a newline
    source: str  # the whole function, dedented
    docstring: str | None
    prefix: str  # the file's text before the header (for completion prompts)
    indent: str  # the header's original indentation
    body: str  # the original body lines (indented as in the file)


def extract_functions(text: str, max_lines: int = 30) -> list[Function]:
    """Functions and methods of `text` whose body starts on a new line and that span <= max_lines lines."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first_body = node.body[0].lineno
        if first_body <= node.lineno or node.end_lineno is None:
            continue
        if node.body[0].col_offset <= node.col_offset:
            continue
        start = node.lineno - 1
        if node.decorator_list:
            start = min(d.lineno for d in node.decorator_list) - 1
        if node.end_lineno - start > max_lines:
            continue
        header_lines = lines[node.lineno - 1 : first_body - 1]
        if any(line.strip().startswith("#") or not line.strip() for line in header_lines):
            continue
        body_lines = lines[first_body - 1 : node.end_lineno]
        src = "".join(lines[start : node.end_lineno])
        indent = lines[node.lineno - 1][: len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
        a = node.args
        args = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        out.append(Function(node.name, args, "".join(header_lines), textwrap.dedent(src),
                            ast.get_docstring(node), "".join(lines[: node.lineno - 1]), indent,
                            "".join(body_lines)))
    return out
