"""Every keyword argument kernels/ops.py passes to an op's implementation is accepted all the way down.

The dispatchers of kernels/triton_ops.py (and some CPU / reference forms) take `**kw` and hand it on to
whichever kernel fits the shapes. A keyword added in ops.py (as `host=` was, for the chunked KDA's host
lists) must then be accepted, or dropped, on every such path; a path the CPU tests never take (the Triton
token-serial KDA for decode-shaped prefills ran only on the GPU) once raised TypeError there. This test
follows the `**kw` forwarding statically: for each op, the keywords its ops.py wrapper passes; for each
registered implementation (reference, CPU, Triton), every call inside it that forwards `**kw` (after the
`kw.pop(...)`s of the function) must reach a callee whose signature binds those keywords, recursively.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import _triton_cpu  # noqa: F401  (sets TRITON_INTERPRET=1 before any kernel module is imported)
import pytest

from k3serve.kernels import cpu, ops, reference, triton_ops


def _op_keywords() -> dict[str, set[str]]:
    """{op name: keyword names its kernels/ops.py wrapper passes to `_impl(name, x)(...)`}."""
    tree = ast.parse(inspect.getsource(ops))
    found: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Call) and isinstance(node.func.func, ast.Name)
                and node.func.func.id == "_impl" and isinstance(node.func.args[0], ast.Constant)):
            found.setdefault(node.func.args[0].value, set()).update(k.arg for k in node.keywords if k.arg)
    return found


def _resolve(expr: ast.expr, fn, local: dict[str, list[ast.expr]]) -> list:
    """The objects a call's callee expression may be (a local name assigned `a if c else b` gives both)."""
    if isinstance(expr, ast.Name) and expr.id in local:
        return [o for e in local[expr.id] for o in _resolve(e, fn, {})]
    if isinstance(expr, ast.IfExp):
        return _resolve(expr.body, fn, local) + _resolve(expr.orelse, fn, local)
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return []
    scope = {**fn.__globals__, **inspect.getclosurevars(fn).nonlocals}
    obj = scope.get(expr.id)
    for a in reversed(parts):
        obj = getattr(obj, a, None)
    return [obj] if callable(obj) else []


def forwarding_errors(fn, keywords: set[str], path: str = "", seen: frozenset = frozenset()) -> list[str]:
    """Where `fn(..., **{k: ... for k in keywords})` would fail with an unexpected keyword, following `**kw`."""
    fn = inspect.unwrap(fn)
    name = f"{path} -> {fn.__module__}.{fn.__qualname__}" if path else f"{fn.__module__}.{fn.__qualname__}"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    params = sig.parameters.values()
    var_kw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if var_kw is None:
        bad = sorted(keywords - named)
        return [f"{name} takes no {bad}"] if bad else []
    if fn in seen:
        return []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        return []
    body = tree.body[0]
    popped = {n.args[0].value for n in ast.walk(body)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "pop"
              and isinstance(n.func.value, ast.Name) and n.func.value.id == var_kw and n.args
              and isinstance(n.args[0], ast.Constant)}
    local: dict[str, list[ast.expr]] = {}
    for n in ast.walk(body):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            local.setdefault(n.targets[0].id, []).append(n.value)
    passed = (keywords - named) - popped  # what reaches **kw and is not dropped
    errors = []
    for n in ast.walk(body):
        if not isinstance(n, ast.Call):
            continue
        if not any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == var_kw for k in n.keywords):
            continue
        explicit = {k.arg for k in n.keywords if k.arg}
        for callee in _resolve(n.func, fn, local):
            errors += forwarding_errors(callee, passed | explicit, name, seen | {fn})
    return errors


OPS_KEYWORDS = _op_keywords()


def test_the_walk_sees_the_ops():
    # (the ops whose wrappers pass keywords, and their registrations)
    assert {"kda_chunked", "kda_decode", "moe_experts", "moe_route"} <= set(OPS_KEYWORDS)
    assert "host" in OPS_KEYWORDS["kda_chunked"] and "checkpoint_seq" in OPS_KEYWORDS["kda_chunked"]
    # a keyword nobody takes is reported at every kernel the real dispatcher can reach
    errors = forwarding_errors(triton_ops.IMPLS["kda_chunked"], {"bogus"})
    reached = {e.rsplit(" -> ", 1)[-1].split(" takes")[0].rsplit(".", 1)[-1] for e in errors}
    assert reached == {"kda_chunked", "kda_recurrent_triton", "kda_chunked_triton"}, errors


@pytest.mark.parametrize("op", sorted(OPS_KEYWORDS))
def test_every_implementation_takes_the_keywords_ops_passes(op):
    impls = [getattr(reference, op)]
    impls += [m[op] for m in (cpu.OPS, triton_ops.IMPLS) if op in m]
    errors = [e for f in impls for e in forwarding_errors(f, OPS_KEYWORDS[op])]
    assert not errors, "\n".join(errors)


def test_the_check_finds_a_keyword_forwarded_where_it_is_not_taken():
    """The bug this test is for: a dispatcher that pops one keyword but forwards another to a callee without it."""

    def serial(q, *, scale=None):
        return q

    def chunked(q, *, scale=None, chunk_size=64, host=None):
        return q

    def dispatcher(q, **kw):
        if q:
            kw.pop("chunk_size", None)
            return serial(q, **kw)
        return chunked(q, **kw)

    errors = forwarding_errors(dispatcher, {"scale", "chunk_size", "host"})
    assert len(errors) == 1 and "serial" in errors[0] and "'host'" in errors[0], errors
    assert forwarding_errors(dispatcher, {"scale", "chunk_size"}) == []
