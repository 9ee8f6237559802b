"""MXFP4: known code values, nibble order, scale rule, pack/unpack and quantize/dequantize round trips."""

import math

import pytest
import torch

from k3serve.kernels.reference.mxfp4 import (
    E2M1_VALUES,
    e2m1_encode,
    mxfp4_dequantize,
    mxfp4_linear,
    mxfp4_quantize,
    pack_nibbles,
    unpack_nibbles,
)

torch.set_num_threads(1)


def test_e2m1_table_is_the_ocp_one():
    assert E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def test_known_bytes_dequantize_to_known_values():
    # byte 0x21: element 0 = low nibble 1 (0.5), element 1 = high nibble 2 (1.0); 0xA9: -0.5 (9) then -1.0 (A)
    row = [0x21, 0xA9, 0x7F, 0x00] + [0x00] * 12  # 32 elements, one scale
    packed = torch.tensor([row], dtype=torch.uint8)
    want_head = [0.5, 1.0, -0.5, -1.0, -6.0, 6.0, 0.0, 0.0]
    for scale_byte, mult in ((127, 1.0), (128, 2.0), (125, 0.25), (0, 2.0**-127)):
        out = mxfp4_dequantize(packed, torch.tensor([[scale_byte]], dtype=torch.uint8), torch.float64)
        assert out.shape == (1, 32)
        assert out[0, :8].tolist() == [v * mult for v in want_head]
        assert out[0, 8:].abs().sum() == 0


def test_encode_rounds_to_nearest_with_ties_to_even_code_and_saturates():
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.9, 100.0, -0.75, -2.6, -0.1])
    codes = e2m1_encode(x).tolist()
    #         0  .2 .25 .3 .75 1.25 1.75 2.5 3.5  5  5.1 7.9 100 -.75 -2.6 -0.1
    assert codes == [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8 | 2, 8 | 5, 0]


def test_pack_order_low_nibble_first_and_unpack_inverse():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    g = torch.Generator().manual_seed(0)
    many = torch.randint(0, 16, (3, 5, 64), generator=g).to(torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(many)), many)


def test_scale_rule_floor_log2_amax_minus_two():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 128, generator=g) * torch.tensor([1e-3, 0.1, 1.0, 3.0, 40.0, 1000.0])[:, None]
    w[0, :32] = 0.0  # an all-zero group
    _, scales = mxfp4_quantize(w)
    for n in range(6):
        for j in range(4):
            amax = w[n, 32 * j : 32 * (j + 1)].abs().max().item()
            want = 0 if amax == 0 else math.floor(math.log2(amax)) - 2 + 127
            assert scales[n, j].item() == want, (n, j, amax)


def _literal_quant_dequant(w: torch.Tensor) -> torch.Tensor:
    """Brute force: per group, candidates ±E2M1 * 2^e; pick the nearest, ties to the even magnitude code."""
    out = torch.empty_like(w, dtype=torch.float64)
    for n in range(w.shape[0]):
        for j in range(w.shape[1] // 32):
            grp = w[n, 32 * j : 32 * (j + 1)].double()
            amax = grp.abs().max().item()
            e = (math.floor(math.log2(amax)) - 2) if amax > 0 else -127
            for i, v in enumerate(grp.tolist()):
                mag = abs(v) / 2.0**e
                best = min(range(8), key=lambda c: (abs(E2M1_VALUES[c] - mag), c % 2))
                out[n, 32 * j + i] = math.copysign(E2M1_VALUES[best] * 2.0**e, v) if best else 0.0
    return out


def test_quantize_matches_literal_nearest_rounding():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 96, generator=g) * 3
    w[1, 5] = 1e-30
    packed, scales = mxfp4_quantize(w)
    assert packed.shape == (4, 48) and scales.shape == (4, 3)
    assert packed.dtype == scales.dtype == torch.uint8
    assert torch.equal(mxfp4_dequantize(packed, scales, torch.float64), _literal_quant_dequant(w))


def test_dequantize_quantize_round_trip_is_exact():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2, 3, 8, 64), generator=g)
    codes[..., ::32] = torch.randint(6, 8, codes[..., ::32].shape, generator=g)  # group max at code 6 or 7
    packed = pack_nibbles(codes.to(torch.uint8))
    scales = torch.randint(100, 150, (2, 3, 8, 2), generator=g).to(torch.uint8)
    dq = mxfp4_dequantize(packed, scales)  # leading dims [2, 3] pass through
    assert dq.shape == (2, 3, 8, 64)
    p2, s2 = mxfp4_quantize(dq)
    assert torch.equal(s2, scales)
    # -0.0 and +0.0 both dequantize to zero; compare values, then codes away from zeros
    assert torch.equal(mxfp4_dequantize(p2, s2), dq)
    nonzero = (codes % 8) != 0
    assert torch.equal(unpack_nibbles(p2)[nonzero], codes.to(torch.uint8)[nonzero])


def test_bf16_input_and_dtype_of_output():
    w = torch.randn(2, 32, dtype=torch.bfloat16)
    p, s = mxfp4_quantize(w)
    assert mxfp4_dequantize(p, s, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(mxfp4_dequantize(p, s, torch.bfloat16).float(), mxfp4_dequantize(p, s))


def test_linear_equals_matmul_with_dequantized_weight():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(16, 64, generator=g)
    x = torch.randn(5, 64, generator=g, dtype=torch.float64)
    p, s = mxfp4_quantize(w)
    assert torch.allclose(mxfp4_linear(x, p, s), x @ mxfp4_dequantize(p, s, torch.float64).T, rtol=0, atol=1e-12)


def test_shape_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.randn(2, 48))
    with pytest.raises(ValueError, match="disagree"):
        mxfp4_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError):
        mxfp4_dequantize(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
