"""Chat fine-tuning examples for the demo model, rendered by the K3 chat program (k3serve/chat/renderer.py).

Each example is built from one standard-library function (`corpus.extract_functions`, training files
only) and is one of:

* write: "Write a Python function `f(a, b)` that <docstring's first line>" -> a fenced code block with
  the function; thinking on with an empty or a short reasoning section, or thinking off;
* explain: "What does this function do?" + the code -> one sentence from the docstring;
* tool call: with tools declared, "Look up `module.f` in the docs" -> a `search_docs` call (no content),
  or "Run ..." -> a `run_python` call; then, as a second example, the tool's result -> a short answer.

`render_example(tok, messages, final, **kw)` -> (token ids, loss mask): the prompt is the conversation
rendered with the generation prefix; the completion is what the full rendering (conversation + the final
assistant message) adds after it, ending with `<|end_of_msg|>`. Only completion tokens carry loss.
"""

from __future__ import annotations

import random

from k3serve.chat.renderer import render_chat

from .corpus import Function

TOOLS = [
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the Python documentation.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "run_python", "description": "Run Python code and return its output.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
]

WRITE_TEMPLATES = [
    "Write a Python function `{sig}` that {doc}",
    "Write a function {name}({args}) in Python. It should {doc}",
    "Implement `{sig}`: {doc}",
    "Can you write `{name}`? {Doc}",
    "Please write a Python function named {name} that takes {argtext} and {doc}",
]
REASONING_TEMPLATES = [
    "The function {name} takes {argtext}. I will write it in plain Python.",
    "I need a function named {name}. It should {doc}",
    "Short function; the standard library has one like it.",
]


def _doc_line(f: Function) -> str | None:
    if not f.docstring:
        return None
    line = f.docstring.strip().splitlines()[0].strip()
    if len(line) < 12 or len(line) > 160:
        return None
    return line


def _lower_first(s: str) -> str:
    return s[:1].lower() + s[1:]


def _argtext(f: Function) -> str:
    args = [a for a in f.args if a not in ("self", "cls")]
    if not args:
        return "no arguments"
    return ", ".join(f"`{a}`" for a in args)


def render_example(tok, messages: list[dict], final: dict, **kw) -> tuple[list[int], list[int]]:
    prompt = render_chat(tok, messages, add_generation_prompt=True, **kw).token_ids
    full = render_chat(tok, [*messages, final], add_generation_prompt=False, **kw).token_ids
    if full[: len(prompt)] != prompt:
        raise ValueError("the full rendering does not extend the prompt rendering")
    return full, [0] * len(prompt) + [1] * (len(full) - len(prompt))


def make_examples(tok, funcs: list[tuple[str, Function]], seed: int = 0, max_tokens: int = 512):
    """[(ids, mask)] from (module name, function) pairs; examples longer than max_tokens are dropped."""
    r = random.Random(seed)
    out = []
    for module, f in funcs:
        doc = _doc_line(f)
        if doc is None:
            continue
        args = [a for a in f.args if a not in ("self", "cls")]
        fmt = {"name": f.name, "args": ", ".join(args), "sig": f"{f.name}({', '.join(args)})",
               "doc": _lower_first(doc), "Doc": doc, "argtext": _argtext(f)}
        code = f"```python\n{f.source.rstrip()}\n```"
        kind = r.random()
        exs = []
        if kind < 0.6:
            user = r.choice(WRITE_TEMPLATES).format(**fmt)
            mode = r.random()
            if mode < 0.3:
                exs.append(([{"role": "user", "content": user}], {"role": "assistant", "content": code},
                             {"thinking": False}))
            else:
                reasoning = r.choice(REASONING_TEMPLATES).format(**fmt) if mode < 0.65 else ""
                exs.append(([{"role": "user", "content": user}],
                            {"role": "assistant", "reasoning_content": reasoning, "content": code}, {}))
        elif kind < 0.75:
            user = f"What does this function do?\n\n{code}"
            exs.append(([{"role": "user", "content": user}],
                        {"role": "assistant", "reasoning_content": "", "content": f"`{f.name}`: {doc}"}, {}))
        else:
            if r.random() < 0.6:
                q = f"{module}.{f.name}"
                user = r.choice(["Look up `{q}` in the Python docs.", "Use the docs to find out what {q} does.",
                                 "Search the documentation for {q}."]).format(q=q)
                call = {"id": "search_docs:0", "type": "function",
                        "function": {"name": "search_docs", "arguments": {"query": q}}}
                result = f"{q}: {doc}"
            else:
                snippet = f"from {module} import {f.name}\nprint({f.name}.__doc__)" if module else f"print({f.name})"
                user = f"Run this with the tool:\n```python\n{snippet}\n```"
                call = {"id": "run_python:0", "type": "function",
                        "function": {"name": "run_python", "arguments": {"code": snippet}}}
                result = doc
            first = {"role": "assistant", "reasoning_content": "", "content": "", "tool_calls": [call]}
            msgs = [{"role": "user", "content": user}]
            exs.append((msgs, first, {"tools": TOOLS}))
            msgs2 = [*msgs, first, {"role": "tool", "tool_call_id": call["id"], "content": result}]
            exs.append((msgs2, {"role": "assistant", "reasoning_content": "", "content": f"`{f.name}`: {doc}"},
                        {"tools": TOOLS}))
        for msgs, final, kw in exs:
            ids, mask = render_example(tok, msgs, final, **kw)
            if len(ids) <= max_tokens:
                out.append((ids, mask))
    return out
