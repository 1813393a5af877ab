"""Numba CUDA kernels for the whole qwen3moe forward, one module per family.

    packing        GGUF blocks split into aligned planes (the layout every kernel reads)
    quant_device   octet dequantizers: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16, F32
    quant_dot      octet dot products with the block scale factored out (the GEMVs' inner loop)
    gemv           decode matrix-vector, optional fused RMSNorm and residual add
    gemv_multi     two or three GEMVs sharing x (q, k, v) in one launch
    gemv_native    the decode GEMVs and expert products with a linked C++ inner loop (GPU only)
    gemm           prefill matrix-matrix, dequantization fused into shared-memory tiles (FFMA tiles)
    gemm_mma       the same products on tensor cores: f16 tiles, mma.m16n8k16 fragments
    tensor_core    declaring linked CUDA C++ device functions (cuda/*.cu) for Numba kernels
    norm, rope     RMSNorm; per-head q/k norm fused with RoPE (NeoX and normal)
    kvcache        K/V append in F16, Q8_0, Q4_0
    attention      causal GQA over the cache, prefill (FFMA tiles) and the split-KV combine; dispatches
    attention_mma  prefill attention on tensor cores (flash-attention 2, fused C++ KV loop)
    attention_decode_mma  one decode token on tensor cores: that KV loop over one KV split a block
    attention_decode      one decode token in FFMA, a warp per query head (other head dims)
    moe_route      softmax top-k routing, grouping of routed pairs by expert
    moe            expert products, prefill (tiled, gathered) and decode (GEMV-shaped)
    activation     SwiGLU
    sample         greedy and top-k / top-p / temperature token selection
    elementwise    embedding gather from a quantized table, residual add
    block_reduce   shared-memory block reductions (the simulator has no warp shuffles)

Every host wrapper validates its inputs, picks the grid and documents its launch config; kernels
compile once per format and configuration. The same code runs under NUMBA_ENABLE_CUDASIM=1; the
tensor-core paths run their pure-Numba twins there (same fragment layout, same roundings), and the
GPU tests compare the linked C++ against the twins and the NumPy reference.
"""
