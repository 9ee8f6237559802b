"""The host tier's CUDA copy path (pinned host pool, side stream, non-blocking copies): pages saved
device -> host and loaded back (from the host and from device-resident pages in the same step) are
byte-identical; the compute stream sees the loads after wait_for_load. No model needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from k3serve.workers.engine.cache_layout import KVCacheTensors, plan_cache_layout  # noqa: E402
from k3serve.workers.engine.kv_connector.base import ConnectorContext  # noqa: E402
from k3serve.workers.engine.kv_connector.host_offload import HostOffloadMeta, HostOffloadWorker  # noqa: E402


def test_cuda_saves_and_loads_are_exact():
    cfg = SimpleNamespace(kda_layer_ids=[0, 1, 2], mla_layer_ids=[3], kv_lora_rank=16, qk_rope_head_dim=8,
                          kda_num_heads=1, kda_head_dim=8, conv_kernel_size=4)
    lay = plan_cache_layout(cfg, torch.float32, block_size=8)
    kv = KVCacheTensors(lay, 16, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for p in kv.pages:
        p.copy_(torch.randint(0, 256, p.shape, generator=g, device="cuda", dtype=torch.int64).to(torch.uint8))
    w = HostOffloadWorker(ConnectorContext(lay, 4, b"\0" * 32, "cuda", "t", True), num_slots=8)
    assert w.host.is_pinned()
    w.register_kv_caches(kv)
    before = [p.clone() for p in kv.pages]
    # step 1: save blocks 3, 4 to slots 1, 2 (no loads: committed at get_finished)
    w.start_load_kv(HostOffloadMeta(step=1, saves=[(3, 1), (4, 2)]))
    w.wait_for_load()
    w.get_finished()
    for j, p in enumerate(before):
        assert torch.equal(w.host[1, j], p[3].cpu()) and torch.equal(w.host[2, j], p[4].cpu())
    # step 2: save block 5 -> slot 3, and in the same step load slot 3 -> block 9 (saved this very step),
    # slot 1 -> block 10, device block 6 -> block 11
    w.start_load_kv(HostOffloadMeta(step=2, saves=[(5, 3)], loads=[("h", 3, 9), ("h", 1, 10), ("d", 6, 11)],
                                    load_requests=["r"]))
    w.wait_for_load()
    out = w.get_finished()
    assert not out.failed_recving
    for j, p in enumerate(kv.pages):
        assert torch.equal(p[9], before[j][5]) and torch.equal(p[10], before[j][3])
        assert torch.equal(p[11], before[j][6])
    assert out.stats["stored_bytes"] == 3 * lay.bytes_per_block
    assert out.stats["loaded_bytes"] == 2 * lay.bytes_per_block
