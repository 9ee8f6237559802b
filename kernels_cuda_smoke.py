"""Temporary: every reference op on CUDA tensors == the same op on CPU (device-handling smoke)."""
import torch

from k3serve.kernels import ops
from k3serve.kernels.reference import mxfp4

torch.manual_seed(0)
D = "cuda"


def both(fn, *args, mutable=(), **kw):
    cpu_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    cu_args = [a.to(D) if isinstance(a, torch.Tensor) else a for a in args]
    cpu_kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    cu_kw = {k: v.to(D) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    r1, r2 = fn(*cpu_args, **cpu_kw), fn(*cu_args, **cu_kw)
    outs = [(r1, r2)] if isinstance(r1, torch.Tensor) else list(zip(r1 or [], r2 or []))
    outs += [(cpu_args[i], cu_args[i]) for i in mutable]
    for a, b in outs:
        assert b.device.type == "cuda", fn.__name__
        torch.testing.assert_close(b.cpu().to(a.dtype), a, rtol=1e-4, atol=1e-4)
    print("ok", fn.__name__)


x = torch.randn(9, 8)
both(ops.rms_norm, x, torch.randn(8), 1e-5)
both(ops.l2_normalize, x)
both(ops.situ_and_mul, x, 4.0, 25.0)
both(ops.silu_and_mul, x)
cu, si, hi = torch.tensor([0, 4, 9]), torch.tensor([2, 0]), torch.tensor([True, False])
ck = dict(checkpoint_seq=torch.tensor([1, 0]), checkpoint_offsets=torch.tensor([2, 4]),
          checkpoint_slots=torch.tensor([1, 3]))
both(ops.causal_conv1d_varlen, x, torch.randn(8, 4), torch.randn(4, 8, 3), si, cu, hi, mutable=(2,), **ck)
g = ops.kda_gate(torch.randn(9, 2, 8), torch.randn(2), torch.randn(16), -5.0)
both(ops.kda_gate, torch.randn(9, 2, 8), torch.randn(2), torch.randn(16), -5.0)
qkv = [torch.randn(9, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 6), g, torch.rand(9, 2)]
both(ops.kda_recurrent, *qkv, torch.randn(4, 2, 6, 8), si, cu, hi, mutable=(5,), **ck)
both(ops.kda_chunked, *qkv, torch.randn(4, 2, 6, 8), si, cu, hi, mutable=(5,), chunk_size=3, **ck)
both(ops.attn_res, torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 4, 8), torch.randn(8), torch.randn(1, 8),
     torch.randn(8), 2, 2, 1e-5, None, torch.bfloat16, mutable=(0, 2))
cache = torch.randn(6, 4, 20)
both(ops.mla_write_cache, torch.randn(5, 16), torch.randn(5, 4), cache, torch.tensor([3, -1, 9, 0, 23]),
     mutable=(2,))
bt = torch.tensor([[5, 1, 0], [2, 4, 3]], dtype=torch.int32)
both(ops.mla_paged_attention, torch.randn(4, 3, 16), torch.randn(4, 3, 4), cache, bt, torch.tensor([7, 10]),
     torch.tensor([0, 3, 4]), 0.2, kv_lora_rank=16)
both(ops.mla_attention_expanded, torch.randn(2, 3, 8), torch.randn(2, 3, 4), torch.randn(5, 3, 8),
     torch.randn(5, 4), torch.randn(5, 3, 6), 0.2)
lg = torch.randn(6, 8)
both(ops.moe_route, lg, torch.randn(8), 3, num_expert_group=4, topk_group=2)
w, ids = ops.moe_route(lg, None, 2)
p13, s13 = mxfp4.mxfp4_quantize(torch.randn(8, 64, 32))
p2, s2 = mxfp4.mxfp4_quantize(torch.randn(8, 32, 32))
both(ops.moe_experts, torch.randn(6, 32), w, ids, w13_packed=p13, w13_scale=s13, w2_packed=p2, w2_scale=s2,
     situ_linear_beta=25.0)
both(ops.moe_experts, torch.randn(6, 32), w, ids, w13=torch.randn(8, 64, 32), w2=torch.randn(8, 32, 32))
print("ALL OK")
