"""Write [c_kv | k_pe] rows into the paged MLA latent cache in Triton (no host sync, so a decode step that
writes the cache can be captured in a CUDA graph). Contract: `k3serve.kernels.reference.mla_write_cache`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import any_f64, next_pow2


@triton.jit
def _mla_write_kernel(ckv_ptr, kpe_ptr, cache_ptr, slot_ptr, c_stride, p_stride, s_blk, s_off, bs,
                      L: tl.constexpr, R: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        dst = cache_ptr + (slot // bs) * s_blk + (slot % bs) * s_off
        rl = tl.arange(0, BL)
        ml = rl < L
        c = tl.load(ckv_ptr + t * c_stride + rl, mask=ml, other=0.0)
        tl.store(dst + rl, c.to(cache_ptr.dtype.element_ty), mask=ml)
        rr = tl.arange(0, BR)
        mr = rr < R
        p = tl.load(kpe_ptr + t * p_stride + rr, mask=mr, other=0.0)
        tl.store(dst + L + rr, p.to(cache_ptr.dtype.element_ty), mask=mr)


def supported(c_kv, k_pe, kv_cache) -> bool:
    return (not any_f64(c_kv, k_pe, kv_cache) and kv_cache.stride(-1) == 1 and c_kv.stride(-1) == 1
            and k_pe.stride(-1) == 1 and c_kv.device == kv_cache.device)


def mla_write_cache_triton(c_kv, k_pe, kv_cache, slot_mapping) -> None:
    """Triton implementation of `reference.mla_write_cache` (same arguments; writes the cache in place)."""
    L, R = c_kv.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != L + R:
        raise ValueError(f"kv_cache last dim {kv_cache.shape[-1]} != {L} + {R}")
    T = c_kv.shape[0]
    if T == 0:
        return
    slots = slot_mapping.to(device=kv_cache.device)
    _mla_write_kernel[(T,)](c_kv, k_pe, kv_cache, slots, c_kv.stride(0), k_pe.stride(0), kv_cache.stride(0),
                            kv_cache.stride(1), kv_cache.shape[1], L=L, R=R, BL=next_pow2(L), BR=next_pow2(R),
                            num_warps=4 if L + R >= 512 else 1)
