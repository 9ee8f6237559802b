"""The fused KDA decode (kernels/triton/kda_decode.py) reads qkv, the beta logits and the gate in place as column
slices of one wider tensor (how the engine passes its merged input projection, workers/engine/k3_forward.py):
under the CPU interpreter the outputs, states and conv states equal those of the same call on contiguous copies,
bit for bit, for the single-launch and the split (epilogue) variants, and match the float64 reference."""

import _triton_cpu  # (sets TRITON_INTERPRET=1 first)
import pytest
import torch
from _triton_cpu import rel
from test_triton_kda_decode_variants import make_case

from k3serve.kernels import reference as R
from k3serve.kernels.triton.kda_decode import kda_decode_triton

pytestmark = _triton_cpu.skip_on_cuda


@pytest.mark.parametrize("variant", [{}, dict(block_v=16, v_splits=2)])
def test_column_slices_equal_contiguous(variant):
    N, H, K = 5, 2, 16
    qkv, cw, cs, rest, pool, si, init, _ = make_case(N, H, K, torch.bfloat16, seed=3)
    raw_g, A_log, dt_bias, beta_logit, gate, onw = rest
    C = qkv.shape[1]
    # one [N, C + H + H*K + 7] tensor holding qkv | beta logits | gate | junk, as the merged projection's output
    merged = torch.randn(N, C + H + H * K + 7).to(torch.bfloat16)
    merged[:, :C] = qkv
    merged[:, C:C + H] = beta_logit
    merged[:, C + H:C + H + H * K] = gate.reshape(N, H * K)
    views = merged[:, :C], merged[:, C:C + H], merged[:, C + H:C + H + H * K]
    assert not any(v.is_contiguous() for v in views)
    outs = []
    for q_, b_, g_ in (views, (qkv, beta_logit, gate)):
        c2, p2 = cs.clone(), pool.clone()
        o = kda_decode_triton(q_, cw, c2, raw_g, A_log, dt_bias, b_, g_, onw, p2, si, init, lower_bound=-5.0,
                              **variant)
        outs.append((o, c2, p2))
    (o1, c1, p1), (o2, c2, p2) = outs
    assert torch.equal(o1, o2)
    assert torch.equal(c1.nan_to_num(7.0), c2.nan_to_num(7.0)) and torch.equal(p1.nan_to_num(7.0), p2.nan_to_num(7.0))
    ref = R.kda_decode(qkv.double(), cw.double(), cs.double(), *(a.double() for a in rest), pool.double(), si, init,
                       lower_bound=-5.0)
    assert rel(o1[si >= 0], ref[si >= 0]) < 6e-3
    # the reference op takes the same column slices (the CPU engine passes them too)
    md = merged.double()
    ref2 = R.kda_decode(md[:, :C], cw.double(), cs.double(), raw_g.double(), A_log.double(), dt_bias.double(),
                        md[:, C:C + H], md[:, C + H:C + H + H * K], onw.double(), pool.double(), si, init,
                        lower_bound=-5.0)
    assert torch.equal(ref2.nan_to_num(7.0), ref.nan_to_num(7.0))
