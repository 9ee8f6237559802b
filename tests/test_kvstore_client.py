"""kvstore building blocks against a real `mooncake_master`: launcher, client lifetime, service
deadlines and health, key scheme, the joint-hit rule. Runs in a private network namespace."""

from __future__ import annotations

import time

import pytest
import torch

from k3serve.kvstore.netns import enter_private_netns, in_private_netns

enter_private_netns()  # Mooncake clients listen on every interface: loopback-only namespace (root)

from k3serve.kvstore.client import StoreClient, StoreClosed  # noqa: E402
from k3serve.kvstore.keys import KeySpace, geometry_id, salt_tag  # noqa: E402
from k3serve.kvstore.lookup import find_joint_hit  # noqa: E402
from k3serve.kvstore.master import MooncakeMaster, master_args  # noqa: E402
from k3serve.kvstore.service import DeadlineMissed, StoreService, StoreUnavailable  # noqa: E402


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


def test_runs_in_private_namespace():
    assert in_private_netns()


def test_master_args_shared_with_operator():
    from k3serve.operator.render_services import kvstore_args

    a = master_args("$(K3SERVE_POD_IP)", 50051, "$(K3SERVE_POD_IP)", 9100)
    assert kvstore_args() == a
    assert "--enable_http_metadata_server=false" in a and "--rpc_address=$(K3SERVE_POD_IP)" in a


def test_client_put_get_and_closed_guard(master):
    c = StoreClient(master.address, segment_bytes=16 << 20, local_buffer_bytes=4 << 20)
    assert c.connect()
    src = torch.arange(2 * 4096, dtype=torch.int64).to(torch.uint8).view(2, 4096).contiguous()
    dst = torch.zeros_like(src)
    c.register(src.data_ptr(), src.numel())
    c.register(dst.data_ptr(), dst.numel())
    assert c.batch_put_from(["a", "b"], [src[0].data_ptr(), src[1].data_ptr()], [4096, 4096]) == [0, 0]
    assert c.batch_exists(["a", "b", "zz"]) == [1, 1, 0]
    # get_into returns the byte count on success, a negative code for a missing key
    assert c.batch_get_into(["b", "zz"], [dst[0].data_ptr(), dst[1].data_ptr()], [4096, 4096]) == [4096, -704]
    assert torch.equal(dst[0], src[1])
    assert c.health() == 0
    c.close()
    with pytest.raises(StoreClosed):  # calling the closed native client would segfault: refused
        c.batch_exists(["a"])
    c.close()  # idempotent


def test_connect_fails_fast_without_master():
    c = StoreClient("127.0.0.1:1", segment_bytes=16 << 20)
    t = time.monotonic()
    assert c.connect() is False
    assert time.monotonic() - t < 1.0
    assert c.health() == -1
    c.close()


def test_service_outage_deadline_and_recovery():
    m = MooncakeMaster().start()
    svc = StoreService(StoreClient(m.address, segment_bytes=16 << 20), deadline_s=0.05, probe_interval_s=0.1)
    try:
        svc.start()
        assert svc.wait_available(10)
        assert svc.call(lambda: svc.client.batch_exists(["x"]), op="lookup") == [0]
        m.kill()
        # every call returns within the deadline (or is refused at once) while the master is dead
        t_end = time.monotonic() + 6
        worst = 0.0
        while time.monotonic() < t_end:
            t = time.monotonic()
            try:
                svc.note_codes("exists", svc.call(lambda: svc.client.batch_exists(["x"]), op="lookup"))
            except (StoreUnavailable, DeadlineMissed):
                pass
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.02)
        assert worst < 0.05 + 0.03
        assert not svc.available
        m.start()
        got, t_end = None, time.monotonic() + 20
        while got is None and time.monotonic() < t_end:  # reattached: calls answer again
            try:
                got = svc.call(lambda: svc.client.batch_exists(["x"]), op="lookup", deadline_s=1)
            except (StoreUnavailable, DeadlineMissed):
                time.sleep(0.1)
        assert got == [0]
    finally:
        svc.close()
        m.stop()


def test_key_scheme_separates_salts_models_geometry():
    from k3serve.workers.engine.cache_layout import plan_cache_layout
    from k3serve.workers.model.testing import random_config

    cfg = random_config(0)
    l32 = plan_cache_layout(cfg, torch.float32)
    l64 = plan_cache_layout(cfg, torch.float64)
    assert geometry_id(l32) != geometry_id(l64)
    fp = b"\x01" * 32
    a = KeySpace.for_engine(fp, l32, l32.block_size)
    assert a != KeySpace.for_engine(fp, l64, l64.block_size)
    assert a != KeySpace.for_engine(fp, l32, 16)
    assert a != KeySpace.for_engine(b"\x02" * 32, l32, l32.block_size)
    h = b"\xab" * 32
    assert a.key("alice", 0, h) != a.key("bob", 0, h) != a.key(None, 0, h)
    assert "alice" not in a.key("alice", 0, h) and salt_tag(None) == "-"


def _probe(present):
    return lambda pairs: [p in present for p in pairs]


def test_joint_hit_needs_every_part():
    # B=4, u=2; MLA group 0, KDA groups 1 and 2; hashes named by prefix length
    hs = [bytes([p]) * 32 for p in range(2, 21, 2)]  # hash at 2, 4, ..., 20

    def h(p):
        return bytes([p]) * 32

    kw = dict(block_size=4, unit=2, max_len=19, start=0, mla_groups=[0], kda_groups=[1, 2])
    mla = {(0, h(4)), (0, h(8)), (0, h(12))}
    # KDA snapshot at 10 in both groups, at 12 only in group 1: the joint hit is 10
    kda = {(1, h(10)), (2, h(10)), (1, h(12))}
    r = find_joint_hit(hs, probe=_probe(mla | kda), **kw)
    assert r.tokens == 10
    assert [bi for _g, bi, _h in r.mla_pages] == [0, 1, 2] and r.mla_pages[2][2] == h(12)
    # the MLA page under the snapshot evicted -> the snapshot does not count
    r = find_joint_hit(hs, probe=_probe({(0, h(4))} | kda), **kw)
    assert r.tokens == 0
    # a mid-block tail page (keyed at 10) extends the MLA chain to a snapshot at 10
    r = find_joint_hit(hs, probe=_probe({(0, h(4)), (0, h(8)), (0, h(10))} | kda), **kw)
    assert r.tokens == 10 and r.mla_pages[-1] == (0, 2, h(10))
    # only tokens past the local aligned hit count
    r = find_joint_hit(hs, probe=_probe(mla | kda), **{**kw, "start": 8})
    assert r.tokens == 10 and [bi for _g, bi, _h in r.mla_pages] == [2]
    assert find_joint_hit(hs, probe=_probe(mla | kda), **{**kw, "start": 12}).tokens == 0


def test_bad_store_options_are_clear_errors(tiny_model_dir):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "k3serve.cli", "worker", "--model", str(tiny_model_dir),
                        "--kv-store", "no-port"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "argument --kv-store: expected HOST:PORT, got 'no-port'" in r.stderr
    from k3serve.workers.llm import LLM

    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(str(tiny_model_dir), skip_tokenizer_init=True, max_model_len=64, kv_store="127.0.0.1:1")
    with pytest.raises(ValueError, match="kv_store_staging_bytes: 1000 is smaller than one store object"):
        LLM(str(tiny_model_dir), skip_tokenizer_init=True, max_model_len=64, enable_prefix_caching=True,
            kv_store="127.0.0.1:1", kv_store_staging_bytes=1000)


def test_private_netns_holder_shares_one_loopback():
    import subprocess
    import sys

    from k3serve.kvstore.netns import PrivateNetns

    with PrivateNetns() as ns:
        links = subprocess.run(ns.argv(["ip", "-brief", "link"]), capture_output=True, text=True).stdout
        assert links.split()[0] == "lo" and len(links.strip().splitlines()) == 1 and "UP" in links
        server = subprocess.Popen(ns.argv([sys.executable, "-c", (
            "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); c, _ = s.accept(); c.sendall(b'hi')")]),
            stdout=subprocess.PIPE, text=True)
        port = int(server.stdout.readline())
        got = subprocess.run(ns.argv([sys.executable, "-c", (
            f"import socket; print(socket.create_connection(('127.0.0.1', {port})).recv(2).decode())")]),
            capture_output=True, text=True, timeout=30).stdout.strip()
        server.wait(10)
        assert got == "hi"
        # this process's own loopback is another namespace: the port is not there
        import socket

        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1)
