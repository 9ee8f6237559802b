"""`k3serve serve --kv-events-zmq`: the KV events in vLLM's ZMQ/msgpack wire format (workers/kv_events_zmq.py).

A real server process and a real ZMQ SUB socket: after a request, BlockStored events name exactly the
full-block prefix hashes a router computes from the prompt (k3serve/common/block_hash.py), chained by
parent hash; sequence numbers count from 0; the replay socket returns the buffered batches and the end
marker; a late subscriber gets AllBlocksCleared plus the cache's contents.
"""

import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import pytest
import zmq

from k3serve.common.block_hash import chain_hashes, model_fingerprint, root_hash

BLOCK = 16


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    pub, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "k3serve.cli", "serve", str(tiny_model_dir), "--port", "0", "--enable-prefix-caching",
           "--block-size", str(BLOCK), "--max-model-len", "256", "--num-threads", "1", "--kv-events-zmq", pub,
           "--kv-events-zmq-replay", rep, "--log-level", "warning", "--served-model-name", "tiny"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    url, lines = None, []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        proc.kill()
        pytest.fail("serve did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    yield url, pub, rep
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _recv_all(sock, until, timeout=20.0):
    msgs = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not until(msgs):
        if sock.poll(200):
            topic, seq, payload = sock.recv_multipart()
            msgs.append((struct.unpack(">q", seq)[0], msgpack.unpackb(payload, raw=False)))
    return msgs


def test_block_stored_events_carry_the_router_hashes(server, tiny_model_dir):
    url, pub, rep = server
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)
    time.sleep(0.5)  # PUB/SUB join
    prompt = list(range(20, 20 + 3 * BLOCK + 5))
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    expected = chain_hashes(root_hash(model_fingerprint(str(tiny_model_dir))), prompt, BLOCK)

    def stored(msgs):
        return [e for _, b in msgs for e in b[1] if e[0] == "BlockStored"]

    msgs = _recv_all(sub, lambda m: len(stored(m)) >= 3)
    evs = stored(msgs)
    hashes = [e[1][0] for e in evs]
    assert hashes[:3] == expected[:3]
    assert evs[0][2] is None and evs[1][2] == expected[0] and evs[2][2] == expected[1]  # parent chain
    assert all(e[4] == BLOCK and e[6] == "GPU" for e in evs)
    ts, events, dp = msgs[0][1]
    assert isinstance(ts, float) and dp is None
    seqs = [s for s, _ in msgs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    sub.close(0)
    # replay: everything buffered from 0, then the end marker
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rep)
    dealer.send_multipart([b"", struct.pack(">q", 0)])
    got = []
    while dealer.poll(5000):
        _, seq, payload = dealer.recv_multipart()
        seq = struct.unpack(">q", seq)[0]
        if seq == -1:
            break
        got.append((seq, msgpack.unpackb(payload, raw=False)))
    dealer.close(0)
    assert [s for s, _ in got][:1] == [0]
    assert got[0][1][1][0] == ["AllBlocksCleared"]  # the publisher's own snapshot comes first
    assert {h for _, b in got for e in b[1] if e[0] == "BlockStored" for h in e[1]} >= set(expected[:3])


def test_map_format_is_the_tagged_map_vllm_router_decodes():
    from types import SimpleNamespace

    from k3serve.workers.kv_events_zmq import as_format, vllm_events

    ev = SimpleNamespace(kind="stored", block_hash=b"h" * 32, parent_hash=None, group_id=0, group_kind="mla",
                         num_tokens=32, block_size=16)
    kda = SimpleNamespace(**{**vars(ev), "group_kind": "kda"})
    mid = SimpleNamespace(**{**vars(ev), "num_tokens": 24})
    assert vllm_events([ev, kda, mid]) == [["BlockStored", [b"h" * 32], None, [], 16, None, "GPU"]]
    (m,) = vllm_events([ev], "map")
    assert m["type"] == "BlockStored" and m["block_hashes"] == [b"h" * 32] and m["block_size"] == 16
    assert m["parent_block_hash"] is None and m["token_ids"] == [] and "lora_name" in m
    assert as_format(["AllBlocksCleared"], "map") == {"type": "AllBlocksCleared"}
    gone = SimpleNamespace(**{**vars(ev), "kind": "removed"})
    assert vllm_events([gone], "map") == [{"type": "BlockRemoved", "block_hashes": [b"h" * 32], "medium": "GPU"}]
