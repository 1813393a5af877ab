"""Numba CUDA kernels for the whole qwen3moe forward, one module per family.

Weights and the quantized KV cache:
    packing        GGUF blocks split into aligned planes (quants, scales, extra): the layout every kernel reads
    quant_device   octet dequantizers of every packed format (split load/decode halves: Q4_0, Q8_0, Q4_K,
                   Q6_K, F16, F32)
    quant_dot      octet dot products with the block scale factored out (the Numba GEMVs' inner loop)
    kvcache        K/V rows appended to the cache in F16, Q8_0 or Q4_0 (ggml's rounding)

Decode products (matrix-vector):
    gemv           decode matrix-vector, optional fused RMSNorm and residual add
    gemv_multi     two or three GEMVs sharing x (q, k, v) in one launch
    gemv_native    the decode GEMVs and expert products over linked C++ rows (cuda/gemv_rows.cu): 16-byte
                   loads and warp shuffles; Q4_0, Q8_0, Q4_K and F32 / F16 rows (GPU only), Q5_K and
                   Q6_K built and tested (served once their GPU tests pass)

Prefill products (matrix-matrix):
    gemm           prefill matrix-matrix, dequantization fused into shared-memory tiles (FFMA tiles)
    gemm_config    the GEMM's tile configurations, GemmConfig (FFMA) and MmaConfig (tensor cores), and the
                   defaults that pick between them for a weight format and a chunk's routed rows
    gemm_mma       the same products on tensor cores: f16 tiles, mma.m16n8k16 fragments (cuda/gemm_mma.cu,
                   and its fused C++ K loop for the block formats)
    shared_tiles   the GEMM kernels' shared-memory tiles: static arrays up to 48 KiB, one dynamic block beyond

Mixture of experts:
    moe_route      softmax top-k routing, grouping of routed pairs by expert into row tiles
    decode_route   a decode step's norm, router logits, top-k and slot map in one launch (F32 / F16 routers)
    moe            expert products, prefill (tiled, gathered, on gemm/gemm_mma's main loops) and decode
                   (GEMV-shaped); sends the prefill tiles of moe_rows.FORMATS to moe_rows where it applies
    moe_rows       prefill expert products for chunks of few routed rows an expert: the weight rows on the
                   mma's M, the tile's tokens on its N (cuda/moe_rows.cu; GPU only; Q4_0, Q8_0, Q4_K, Q5_K
                   and Q6_K experts; the engine's choice wherever it applies)
    activation     SwiGLU, for the paths that do not fuse it into the expert GEMM epilogues

Attention:
    attention      causal GQA over the cache, prefill (FFMA tiles) and the split-KV combine; dispatches
                   to the three below
    attention_mma  prefill attention on tensor cores (flash-attention 2; cuda/attention_mma.cu, with a
                   fused C++ KV loop)
    attention_decode_mma  one decode token on tensor cores: that KV loop over one KV split a block
    attention_decode      one decode token in FFMA, a warp per query head (other head dims, no tensor cores)

Norms, positions, tokens:
    norm, rope     RMSNorm; per-head q/k norm fused with RoPE (NeoX and normal)
    elementwise    embedding gather from a quantized table, residual add, a counter step, float16 rounding
    sample         greedy and top-k / top-p / temperature token selection
    drafts         greedy speculation's small steps: a draft chain's step, a verify step's acceptance and
                   the next step's inputs, a row chosen on the device
    block_reduce   the block-wide sum through shared memory the norms reduce with (the simulator has no
                   warp shuffles)

Shared plumbing:
    tensor_core    declaring linked CUDA C++ device functions (cuda/*.cu) for Numba kernels; whether
                   tensor cores are available (compute capability 8.0 or later, and cffi) and why not
    ptx_cache      the sources' PTX, compiled once a text and kept in the user's cache folder between processes
    launcher       every global kernel's launches (``jit``): Numba's argument marshalling done once per
                   argument types, later launches packed directly (a prefill layer is bound by their host cost)
    _common        host-side helpers of every family: input checks, output allocation, constants

cuda/ holds the linked CUDA C++, compiled at first use (NVRTC, once: ptx_cache): attention_mma.cu, gemm_mma.cu,
gemv_rows.cu, moe_rows.cu, reduce.cu (the MoE down epilogue's vector reductions) and common.cuh (the
tensor-core helpers that attention_mma.cu, gemm_mma.cu and moe_rows.cu include).

Every host wrapper validates its inputs, picks the grid and documents its launch config; kernels
compile once per format and configuration. The same code runs under NUMBA_ENABLE_CUDASIM=1; the
tensor-core paths run their pure-Numba twins there (same fragment layout, same roundings), and the
GPU tests compare the linked C++ against the twins and the NumPy reference. gemv_native and moe_rows
have no twin: the simulator runs the Numba kernels that do the same job (gemv, gemv_multi, moe), and
the GPU tests compare the C++ with those.
"""
