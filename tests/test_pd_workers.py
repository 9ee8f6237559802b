"""P/D disaggregation end to end: real `k3serve worker --role prefill|decode` processes, driven over gRPC the
way the router does (docs/serving.md "P/D: prefill, then decode"), NIXL (UCX over shared memory) between
them, float64 random models. Greedy tokens must equal the plain reference forward (the oracle) and the
colocated engine.

Processes (started once for the module, in parallel): P1 prefill (block 16) and D1 decode (block 32 = 2 x
prefill, its free pages poisoned with 0xFF = NaN before use) on model A, both with prefix caching (dense
retention); P2, a second prefill worker on model A that the fault test kills; D2 decode and P3 prefill on
model B (another seed and random config): a second pair, and D2 is the foreign peer of the compatibility check.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import grpc
import httpx
import pytest
import torch

from k3serve.proto import worker_pb2 as pb
from tests._engine_helpers import random_model_dir, reference_outputs
from tests._pd_hops import GREEDY, _sp, decode_hop, pd, prefill_hop
from tests._proc_tree import _listening_sockets
from tests._workers import MAX_LEN, _metric, _start, _wait_ready, worker_group

SEED_A, SEED_B = 11, 12
VOCAB = 60  # model A (seed 11) has 61 token ids; model B more


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    return random_model_dir(tmp, SEED_A), random_model_dir(tmp, SEED_B)


@pytest.fixture(scope="module")
def workers(models):
    a, b = models
    cache = ["--enable-prefix-caching", "--prefix-cache-retention-interval", "dense"]
    specs = {
        "P1": (a, "prefill", "--block-size", "16", *cache),
        "D1": (a, "decode", "--block-size", "32", "--kv-transfer-timeout", "5", *cache),
        "P2": (a, "prefill", "--block-size", "16"),
        "D2": (b, "decode", "--block-size", "32"),
        "P3": (b, "prefill", "--block-size", "16"),
    }
    procs = {k: _start(*v, env_extra={"K3SERVE_KV_POISON_FREE_PAGES": "1"} if k == "D1" else None)
             for k, v in specs.items()}
    with worker_group(procs, stop_timeout=10) as out:
        yield out


def _colocated(model_dir, prompts, max_new, **kw):
    from k3serve.sampling_params import SamplingParams
    from k3serve.workers.llm import LLM

    torch.set_num_threads(1)
    llm = LLM(str(model_dir), dtype="float64", max_model_len=MAX_LEN, skip_tokenizer_init=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_new, **GREEDY))]


def test_pd_greedy_equals_reference_and_colocated(workers, models):
    """Random prompts (one token, shorter than a prefill block, shorter than a decode block, several
    blocks); decode block = 2 x prefill block; decode pages poisoned."""
    rng = random.Random(5)
    lens = [1, 2, 9, 16, 17, 31, 33, rng.randint(40, 120)]
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]
    max_new = 6
    want = reference_outputs(models[0], prompts, max_new)
    assert _colocated(models[0], prompts, max_new, block_size=32) == want
    for i, prompt in enumerate(prompts):
        toks, res = pd(workers["P1"], workers["D1"], f"g{i}", prompt, max_new)
        assert toks == want[i], (len(prompt), res)
        if len(prompt) == 1:
            assert res["outcome"] == "recomputed" and res["reason"] == "nothing_to_pull"
        else:
            assert res["outcome"] == "pulled", res
            assert res["pulled_tokens"] + res["local_cached_tokens"] == len(prompt) - 1 and res["bytes"] > 0
    # every pinned page was released once the decode side confirmed its pull
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        load = workers["P1"].stub.GetLoad(pb.LoadRequest(), timeout=5)
        if load.free_pages == load.total_pages:
            break
        time.sleep(0.2)
    assert load.free_pages == load.total_pages


def test_second_random_config(workers, models):
    rng = random.Random(8)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 15, 40, rng.randint(50, 100))]
    want = reference_outputs(models[1], prompts, 5)
    for i, prompt in enumerate(prompts):
        toks, res = pd(workers["P3"], workers["D2"], f"b{i}", prompt, 5)
        assert toks == want[i] and res["outcome"] == "pulled", res


def test_a_hung_prefill_worker_does_not_stall_the_decode_engine(workers, models):
    """The handshake with a peer that does not answer (SIGSTOP) runs off the engine thread: other
    requests on the decode worker finish meanwhile, and the waiting one recomputes after the handshake
    timeout."""
    p3, d2 = workers["P3"], workers["D2"]
    prompt = [t % VOCAB for t in range(1, 45)]
    kvp = prefill_hop(p3, "hung-p", prompt, 4)
    kvp.remote_engine_id = "not-cached"  # forces a fresh handshake
    os.kill(p3.proc.pid, signal.SIGSTOP)
    try:
        done = {}

        def hung():
            done["hung"] = decode_hop(d2, "hung", prompt, 4, kvp)
            done["hung_t"] = time.monotonic()

        th = threading.Thread(target=hung)
        th.start()
        time.sleep(0.5)
        plain = list(d2.stub.Generate(pb.GenerateRequest(request_id="meanwhile", prompt_token_ids=prompt[:9],
                                                         sampling_params=_sp(3)), timeout=60))
        t_plain = time.monotonic()
        th.join(60)
    finally:
        os.kill(p3.proc.pid, signal.SIGCONT)
    assert plain[-1].finished and t_plain < done["hung_t"]
    toks, res = done["hung"]
    assert (res["outcome"], res["reason"]) == ("recomputed", "peer_unreachable")
    assert toks == reference_outputs(models[1], [prompt], 4)[0]


def test_decode_pulls_only_what_its_prefix_cache_lacks(workers, models):
    """A follow-up turn (prompt + answer + more) on the same decode worker: its own cache supplies the
    prefix it computed during decode (dense KDA snapshots); only the rest is pulled."""
    rng = random.Random(6)
    first = [rng.randrange(VOCAB) for _ in range(60)]
    out1, res1 = pd(workers["P1"], workers["D1"], "turn1", first, 12)
    assert res1["outcome"] == "pulled"
    second = first + out1 + [rng.randrange(VOCAB) for _ in range(5)]
    out2, res2 = pd(workers["P1"], workers["D1"], "turn2", second, 6)
    assert out1 == reference_outputs(models[0], [first], 12)[0]
    assert out2 == reference_outputs(models[0], [second], 6)[0]
    assert res2["outcome"] == "pulled" and res2["local_cached_tokens"] >= 32, res2
    assert res2["pulled_tokens"] == len(second) - 1 - res2["local_cached_tokens"]


def test_expired_pages_cost_a_recompute(workers, models):
    prompt = [t % VOCAB for t in range(3, 50)]
    kvp = prefill_hop(workers["P1"], "exp-p", prompt, 4)
    kvp.remote_blocks_expiry_time = time.time() - 1
    toks, res = decode_hop(workers["D1"], "exp", prompt, 4, kvp)
    assert (res["outcome"], res["reason"]) == ("recomputed", "expired")
    assert toks == reference_outputs(models[0], [prompt], 4)[0]


def test_parameters_of_another_prompt_or_used_twice_are_never_pulled(workers, models):
    """A router that pairs the prefill answer with a different prompt (or salt), or sends it twice, gets a
    recompute, not someone else's state."""
    prompt = [t % VOCAB for t in range(13, 61)]
    other = list(prompt)
    other[20] = (other[20] + 1) % VOCAB
    kvp = prefill_hop(workers["P1"], "mix-p", prompt, 4)
    toks, res = decode_hop(workers["D1"], "mix", other, 4, kvp)
    assert (res["outcome"], res["reason"]) == ("recomputed", "prompt_mismatch")
    want = reference_outputs(models[0], [other, prompt], 4)
    assert toks == want[0]
    # parameters are single-use: the first pull released the prefill's pages, a second one must not read them
    toks, res = decode_hop(workers["D1"], "mix2", prompt, 4, kvp)
    assert res["outcome"] == "pulled" and toks == want[1]
    toks, res = decode_hop(workers["D1"], "mix3", prompt, 4, kvp)
    assert (res["outcome"], res["reason"]) == ("recomputed", "already_pulled") and toks == want[1]


def test_prefill_killed_between_prefill_and_pull_recomputes(workers, models):
    p2, d1 = workers["P2"], workers["D1"]
    prompts = [[t % VOCAB for t in range(7, 47)], [t % VOCAB for t in range(9, 70)], [t % VOCAB for t in range(2, 30)]]
    want = reference_outputs(models[0], prompts, 5)
    toks, res = pd(p2, d1, "k0", prompts[0], 5)  # a first pull caches P2's metadata on D1
    assert res["outcome"] == "pulled" and toks == want[0]
    kvp1, kvp2 = prefill_hop(p2, "k1-p", prompts[1], 5), prefill_hop(p2, "k2-p", prompts[2], 5)
    p2.proc.kill()
    p2.proc.wait(10)
    t0 = time.monotonic()
    toks, res = decode_hop(d1, "k1", prompts[1], 5, kvp1)
    assert toks == want[1] and res["outcome"] == "recomputed"
    assert res["reason"] in ("transfer_failed", "peer_unreachable", "timeout"), res
    # the dead peer's cached metadata was dropped: the next request tries a fresh handshake, which fails
    toks, res = decode_hop(d1, "k2", prompts[2], 5, kvp2)
    assert toks == want[2] and (res["outcome"], res["reason"]) == ("recomputed", "peer_unreachable"), res
    assert time.monotonic() - t0 < 30
    # a new prefill worker on the same address: the decode worker handshakes again and pulls
    port = p2.addr.rsplit(":", 1)[1]
    p2.proc = _start(models[0], "prefill", "--block-size", "16", "--grpc-port", port)
    _wait_ready(p2.proc)
    toks, res = pd(p2, d1, "k3", prompts[2], 5)
    assert toks == want[2] and res["outcome"] == "pulled", res


def test_a_peer_with_a_new_engine_id_is_fetched_again(workers, models):
    """The cached metadata names engine X; parameters naming engine Y at the same address (a restart)
    drop it and refetch; pages of an engine that is no longer there cost a recompute."""
    prompt = [t % VOCAB for t in range(11, 58)]
    want = reference_outputs(models[0], [prompt], 4)[0]
    kvp = prefill_hop(workers["P1"], "eid-p", prompt, 4)
    kvp.remote_engine_id = "restarted-elsewhere"
    toks, res = decode_hop(workers["D1"], "eid", prompt, 4, kvp)
    assert toks == want and (res["outcome"], res["reason"]) == ("recomputed", "peer_unreachable"), res
    toks, res = pd(workers["P1"], workers["D1"], "eid2", prompt, 4)
    assert toks == want and res["outcome"] == "pulled", res


def test_compatibility_mismatch_is_a_clear_error(workers):
    prompt = [t % VOCAB for t in range(5, 40)]
    kvp = prefill_hop(workers["P1"], "mm-p", prompt, 4)
    with pytest.raises(grpc.RpcError) as e:
        decode_hop(workers["D2"], "mm", prompt, 4, kvp)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incompatible P/D peer" in e.value.details() and "model_fingerprint" in e.value.details()
    # the handshake refuses a foreign caller the same way
    req = pb.TransferMetadataRequest(compatibility_hash=b"\0" * 32)
    with pytest.raises(grpc.RpcError) as e:
        workers["P1"].stub.GetTransferMetadata(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_decode_worker_serves_plain_requests(workers):
    """The router skips the prefill hop for short or cached prompts: a decode worker serves them whole."""
    prompt = [t % VOCAB for t in range(4, 30)]
    resps = list(workers["D1"].stub.Generate(pb.GenerateRequest(request_id="plain", prompt_token_ids=prompt,
                                                                sampling_params=_sp(3)), timeout=60))
    assert resps[-1].finished and not resps[-1].HasField("kv_transfer_result")


def test_no_listener_beyond_loopback(workers):
    for name in ("P1", "D1", "D2"):
        socks = _listening_sockets(workers[name].proc.pid)
        assert socks, f"{name}: no listening socket found (the parser is broken)"
        for proto, addr in socks:
            # IPv4 127.0.0.1; IPv6 ::1 or ::ffff:127.0.0.1 (gRPC's dual-stack socket bound to 127.0.0.1)
            ok = addr == "0100007F" if proto in ("tcp", "udp") else addr in (
                "00000000000000000000000001000000", "0000000000000000FFFF00000100007F")
            assert ok, f"{name} listens on {proto} {addr} (not loopback)"


def test_transfer_metrics(workers):
    text = httpx.get(workers["D1"].murl + "/metrics", timeout=10).text
    assert _metric(text, "k3serve_kv_transfers_total", outcome="pulled") >= 5
    assert _metric(text, "k3serve_kv_transfers_total", outcome="recomputed") >= 3
    for view in ("mla", "kda_conv", "kda_ssm"):
        assert _metric(text, "k3serve_kv_transfer_bytes_total", view=view) > 0, view
    assert _metric(text, "k3serve_kv_transfer_seconds_count") >= 5
    assert _metric(text, "k3serve_kv_transfer_failures_total", reason="expired") >= 1
    assert _metric(text, "k3serve_kv_transfer_failures_total", reason="peer_unreachable") >= 1
