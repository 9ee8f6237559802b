"""Driving real prefill/decode workers (tests/_workers.py) the way the router does (docs/serving.md "P/D:
prefill, then decode"): the prefill hop, the decode hop (tokens, or tokens with their logprobs), both in turn
(`pd`), the oracle's logprobs to check them against, `_together` to send several at once, and
`decode_while_first_runs` for a data-parallel decode worker's spreading."""

from __future__ import annotations

import threading
import time

from k3serve.proto import worker_pb2 as pb
from k3serve.proto.convert import kv_transfer_result_from_proto, sampling_to_proto

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _sp(max_new):
    return sampling_to_proto(dict(GREEDY, max_tokens=max_new))


def prefill_hop(w, rid, prompt, max_new):
    resps = list(w.stub.Generate(pb.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling_params=_sp(max_new),
        kv_transfer_params=pb.KvTransferParams(do_remote_decode=True)), timeout=120))
    assert len(resps) == 1 and resps[0].finished and not resps[0].outputs and resps[0].HasField("kv_transfer_params")
    kvp = resps[0].kv_transfer_params
    assert kvp.remote_num_tokens == len(prompt) - 1 and kvp.remote_host == "127.0.0.1"
    return kvp


def decode_hop(w, rid, prompt, max_new, kvp):
    kvp = pb.KvTransferParams.FromString(kvp.SerializeToString())
    kvp.do_remote_prefill = True
    resps = list(w.stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                    sampling_params=_sp(max_new), kv_transfer_params=kvp),
                                 timeout=120))
    toks = [t for r in resps for o in r.outputs for t in o.token_ids]
    assert resps[-1].finished and resps[-1].HasField("kv_transfer_result")
    return toks, kv_transfer_result_from_proto(resps[-1].kv_transfer_result)


def pd(p, d, rid, prompt, max_new):
    return decode_hop(d, rid, prompt, max_new, prefill_hop(p, rid + "-p", prompt, max_new))


def _decode(w, rid, prompt, max_new, kvp):
    """The decode hop with the chosen tokens' logprobs: (tokens, logprobs, KvTransferResult)."""
    kvp = pb.KvTransferParams.FromString(kvp.SerializeToString())
    kvp.do_remote_prefill = True
    sp = sampling_to_proto(dict(temperature=0.0, ignore_eos=True, max_tokens=max_new, logprobs=0))
    resps = list(w.stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                                                    kv_transfer_params=kvp), timeout=120))
    toks = [t for r in resps for o in r.outputs for t in o.token_ids]
    lps = [tl.entries[0].logprob for r in resps for o in r.outputs for tl in o.logprobs]
    assert resps[-1].finished and resps[-1].HasField("kv_transfer_result")
    return toks, lps, kv_transfer_result_from_proto(resps[-1].kv_transfer_result)


def _reference_logprobs(model_dir, prompt, toks) -> list[float]:
    """The oracle's log-probabilities of `toks` after `prompt` (one full forward, no caches)."""
    import torch

    from k3serve.workers.model.reference import load_reference_model

    m = load_reference_model(str(model_dir), dtype=torch.float64)
    with torch.no_grad():
        lp = torch.log_softmax(m.logits(list(prompt) + list(toks))[len(prompt) - 1: -1].double(), dim=-1)
    return [float(lp[i, t]) for i, t in enumerate(toks)]


def _together(fn, n):
    """fn(i) for i in range(n), all at once (threads); the results in order (a failure re-raised)."""
    res, errs = [None] * n, []

    def run(i):
        try:
            res[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errs.append(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    if errs:
        raise errs[0]
    return res


def decode_while_first_runs(d, prompts, news, kvps, watch=None):
    """decode_hop of request 0 on `d`, then of the others once request 0 runs (they arrive while it decodes, so
    its data-parallel rank is the busier one); `watch()` is called over and over until all are done. The
    (tokens, KvTransferResult) of each, in order."""
    results = {}

    def run(i):
        results[i] = decode_hop(d, f"d{i}", prompts[i], news[i], kvps[i])

    first = threading.Thread(target=run, args=(0,))
    first.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and 0 not in results and d.stub.GetLoad(pb.LoadRequest(), timeout=5).running == 0:
        time.sleep(0.01)
    assert 0 not in results  # still decoding when the others arrive
    rest = [threading.Thread(target=run, args=(i,)) for i in range(1, len(prompts))]
    for t in rest:
        t.start()
    while watch is not None and any(t.is_alive() for t in [first, *rest]):
        watch()
        time.sleep(0.02)
    for t in [first, *rest]:
        t.join(120)
    return [results[i] for i in range(len(prompts))]
