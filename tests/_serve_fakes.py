"""Test helpers for the serving layers (not a test module): a scripted LLMEngine stand-in, a tiny
tokenizer, K3 output text builders and an in-thread uvicorn server.
(`import _serve_fakes`: conftest puts tests/ on sys.path).
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from k3serve.detokenizer import IncrementalDetokenizer
from k3serve.outputs import CompletionOutput, Logprob, RequestOutput
from k3serve.tokenizer import K3Tokenizer, write_tokenizer_files

O, C, S, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
END = f"{C}message{S}{EOM}"


def el(name, body="", **attrs):
    head = "".join(f' {k}="{v}"' for k, v in attrs.items())
    return f"{O}{name}{head}{S}{body}{C}{name}{S}"


def tool_call_text(name, args: dict, index=1):
    body = "".join(el("argument", str(v) if isinstance(v, str) else json.dumps(v), key=k,
                      type="string" if isinstance(v, str) else "number") for k, v in args.items())
    return el("call", body, tool=name, index=index)


def make_tokenizer(tmp_dir) -> K3Tokenizer:
    write_tokenizer_files(str(tmp_dir), num_merges=32)
    return K3Tokenizer.from_dir(str(tmp_dir))


_SPECIAL_RE = re.compile(r"(<\|[a-z_]+\|>)")


def encode_marked(tok: K3Tokenizer, text: str) -> list[int]:
    """Token ids of `text` where literal markers like <|open|> become their special ids."""
    ids: list[int] = []
    for piece in _SPECIAL_RE.split(text):
        if not piece:
            continue
        if _SPECIAL_RE.fullmatch(piece):
            ids.append(tok.special_id(piece))
        else:
            ids.extend(tok.encode(piece))
    return ids


@dataclass
class _Seq:
    tokens: itertools.cycle | list
    detok: IncrementalDetokenizer
    ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    finish: str | None = None
    stop_reason: int | str | None = None
    pos: int = 0


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: object
    seqs: list[_Seq]
    cached: int = 0


class FakeEngine:
    """Scripted stand-in for LLMEngine (same contract): each sequence emits the ids of
    `script(prompt_ids, params, seq_index)` one per step (then EOS when the script runs out), with the
    real IncrementalDetokenizer and the engine's finish rules (EOS, stop ids/strings, max_tokens,
    max_model_len). `step_delay` slows steps; `fail_on_step=k` makes the k-th step and every later one raise;
    `fail_if(params_list)` makes a step raise while it returns True for the running requests' params."""

    def __init__(self, tokenizer: K3Tokenizer, *, script=None, max_model_len: int = 512, step_delay: float = 0.0,
                 fail_on_step: int | None = None, cached_tokens: int = 0, fail_if=None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.model_config = SimpleNamespace(vocab_size=tokenizer.vocab_size)
        self.served_model_name = "fake"
        self.script = script or (lambda prompt, params, i: tokenizer.encode(f"Hello from sequence {i}."))
        self.step_delay = step_delay
        self.fail_on_step = fail_on_step
        self.fail_if = fail_if
        self.cached_tokens = cached_tokens
        self.added: list[tuple] = []
        self.aborted: list[str] = []
        self.reqs: dict[str, _Req] = {}
        self._pending: list[RequestOutput] = []
        self.steps = 0

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None):
        if request_id in self.reqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room within max_model_len={self.max_model_len}")
        params.validate()
        self.added.append((request_id, ids, params, cache_salt))
        seqs = []
        for i in range(params.n):
            toks = self.script(ids, params, i)
            seqs.append(_Seq(toks, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                                          params.include_stop_str_in_output),
                             logprobs=[] if params.logprobs is not None else None))
        self.reqs[request_id] = _Req(request_id, ids, params, seqs, min(self.cached_tokens, len(ids)))

    def abort_request(self, request_ids):
        """Like LLMEngine: finishes at once and returns the final outputs (never a later step())."""
        finals = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            r = self.reqs.pop(rid, None)
            if r is None:
                continue
            self.aborted.append(rid)
            for s in r.seqs:
                s.finish = s.finish or "abort"
            finals.append(self._output(r))
        return finals

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs) or bool(self._pending)

    def _next_token(self, s: _Seq) -> int:
        if isinstance(s.tokens, list):
            tok = s.tokens[s.pos] if s.pos < len(s.tokens) else self.tokenizer.eos_token_id
        else:
            tok = next(s.tokens)
        s.pos += 1
        return tok

    def step(self) -> list[RequestOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        self.steps += 1
        if self.fail_on_step is not None and self.steps >= self.fail_on_step:
            raise RuntimeError("simulated engine failure")
        if self.fail_if is not None and self.fail_if([r.params for r in self.reqs.values()]):
            raise OverflowError("simulated poisoned request")
        outs, self._pending = self._pending, []
        for rid, r in list(self.reqs.items()):
            p = r.params
            for s in r.seqs:
                if s.finish:
                    continue
                tok = self._next_token(s)
                s.ids.append(tok)
                if s.logprobs is not None:
                    entry = {tok: Logprob(-0.25, 1, None)}
                    for j in range(p.logprobs):
                        entry.setdefault((tok + j + 1) % self.tokenizer.num_base_tokens, Logprob(-2.0 - j, j + 2, None))
                    s.logprobs.append(entry)
                s.detok.push([tok])
                n = len(s.ids)
                if n >= p.min_tokens and not p.ignore_eos and tok == self.tokenizer.eos_token_id:
                    s.finish = "stop"
                elif n >= p.min_tokens and tok in p.stop_token_ids:
                    s.finish, s.stop_reason = "stop", tok
                elif s.detok.stopped_by is not None:
                    s.finish, s.stop_reason = "stop", s.detok.stopped_by
                elif (p.max_tokens is not None and n >= p.max_tokens) or len(r.prompt) + n >= self.max_model_len:
                    s.finish = "length"
                if s.finish and s.detok.stopped_by is None:
                    s.detok.flush()
            out = self._output(r)
            outs.append(out)
            if out.finished:
                del self.reqs[rid]
        return outs

    def _output(self, r: _Req) -> RequestOutput:
        cos = [CompletionOutput(index=i, text=s.detok.text, token_ids=list(s.ids),
                                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                                finish_reason=s.finish, stop_reason=s.stop_reason) for i, s in enumerate(r.seqs)]
        return RequestOutput(r.rid, None, list(r.prompt), cos, all(c.finish_reason for c in cos),
                             num_cached_tokens=r.cached)

    def stats(self) -> dict:
        return dict(running=len(self.reqs), waiting=0, free_pages=100 - 3 * len(self.reqs), total_pages=100,
                    kv_usage=0.03 * len(self.reqs), kda_slots_used=len(self.reqs), kda_slots_total=50,
                    num_preemptions=0)


class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread (for tests)."""

    def __init__(self, app):
        import uvicorn

        from k3serve.workers.engine_cli import bind_socket

        self.sock = bind_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
