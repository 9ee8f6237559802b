"""DecodeStaging (workers/engine/model_runner.py): the packed decode inputs. For random group counts, sizes and
table widths the typed views tile the buffer without overlap, stay inside it, have the expected dtypes and shapes,
and every size starts at offset 0 (what lets graphs of every size read fixed addresses). The values a decode step
writes through them are checked end to end by tests/test_engine_differential.py::test_static_padded_decode_path
(greedy tokens equal to the float64 reference)."""

import random

import torch

from k3serve.workers.engine.model_runner import DecodeStaging


def test_views_tile_the_buffer():
    rng = random.Random(0)
    for _ in range(50):
        nm, nk, mb = rng.randint(0, 3), rng.randint(0, 3), rng.randint(1, 40)
        cap = rng.randint(1, 64)
        st = DecodeStaging(nm, nk, cap, mb, torch.device("cpu"))
        size = rng.randint(1, cap)
        v = st.views(st.device_buf, size)
        flat = [v[k] for k in ("input_ids", "positions", "cu_seqlens", "seq_lens", "logits_indices",
                               "has_initial_state")] + v["slot_mapping"] + v["state_indices"] + v["block_tables"]
        spans = []
        base = st.device_buf.data_ptr()
        for t in flat:
            lo = t.data_ptr() - base
            spans.append((lo, lo + t.numel() * t.element_size()))
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] <= st.nbytes(size) <= st.device_buf.numel()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert v["cu_seqlens"].shape == (size + 1,) and v["has_initial_state"].dtype == torch.bool
        assert all(t.shape == (size, mb) and t.dtype == torch.int32 for t in v["block_tables"])
        assert all(t.shape == (size,) and t.dtype == torch.int64 for t in v["slot_mapping"] + v["state_indices"])
        h, turn = st.host(size)
        assert turn == 0 and h["input_ids"].shape == (size,)
        assert st.send(turn, size)["input_ids"].data_ptr() == base  # CPU: the host buffer is the device buffer
