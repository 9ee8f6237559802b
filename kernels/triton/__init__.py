"""k3serve.kernels.triton: Triton implementations of the hot ops (CUDA; also run under TRITON_INTERPRET=1).

Each public `*_triton` function has exactly the signature and result of the reference op of the same
name in `k3serve.kernels.reference`; `k3serve.kernels.triton_ops` registers them with the dispatcher.
Modules: kda_chunk (chunked prefill), kda_recurrent (token-serial), kda_decode (fused decode step),
attn_res, mla_decode (absorbed paged MLA), moe (router + MXFP4/dense grouped expert GEMMs).
"""
