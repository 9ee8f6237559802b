"""The demo model's cheap acceptance checks, through the real engine on the CPU (offline `LLM`).

    problems = chat_problems(chat_acceptance(model_dir))     # [] when the model passes

`chat_acceptance` sends two greedy chat requests the way a client would (rendered by the K3 chat program,
parsed by its output parsers): a write-a-function request in the default thinking mode, and a docs
lookup with tools declared. `chat_problems` lists what fails: empty `content` on the first, a first
answer that did not finish (`finish_reason` other than "stop"), or no tool call with JSON-object
arguments on the second.
"""

from __future__ import annotations

import json

from .chat_data import TOOLS

WRITE = [{"role": "user", "content": "Write a Python function `is_palindrome(s)` that returns True if the string "
                                     "s reads the same backwards."}]
LOOKUP = [{"role": "user", "content": "Look up `os.path.join` in the Python docs."}]


def chat_acceptance(model_dir, max_tokens: int = 200) -> dict:
    from k3serve.chat.parsers import parse_output
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    llm = LLM(str(model_dir), dtype="float32", max_model_len=2048)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = {}
    for name, msgs, tools in (("write", WRITE, None), ("lookup", LOOKUP, TOOLS)):
        o = llm.chat(msgs, sp, tools=tools)[0].outputs[0]
        p = parse_output(o.text, thinking=True, tools_enabled=tools is not None)
        out[name] = {"content": p.content, "reasoning": p.reasoning, "finish_reason": o.finish_reason,
                     "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in p.tool_calls],
                     "tokens": len(o.token_ids)}
    return out


def chat_problems(result: dict) -> list[str]:
    problems = []
    w = result["write"]
    if not (w["content"] or "").strip():
        problems.append(f"write: empty content (reasoning {str(w['reasoning'])[:80]!r})")
    if w["finish_reason"] != "stop":
        problems.append(f"write: finish_reason {w['finish_reason']!r}, not 'stop'")
    ok_calls = []
    for c in result["lookup"]["tool_calls"]:
        try:
            if isinstance(json.loads(c["arguments"]), dict):
                ok_calls.append(c)
        except ValueError:
            pass
    if not ok_calls:
        problems.append(f"lookup: no tool call with JSON-object arguments (content "
                        f"{str(result['lookup']['content'])[:80]!r})")
    return problems
