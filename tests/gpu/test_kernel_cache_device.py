"""Kernels kept between processes, on the device: a second process loads the kernel the first compiled
(linked CUDA C++ included) instead of compiling it, and it computes the same; another closure value
compiles again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from numba import cuda, types
    from strata.gpu.kernels import launcher

    twice = cuda.declare_device("strata_cache_test_twice", types.float32(types.float32), abi="c", link=[
        cuda.CUSource(b'extern "C" __device__ float strata_cache_test_twice(float x) { return 2.0f * x; }',
                      name="twice.cu")])

    def make(scale):
        @launcher.jit
        def kernel(out, x):
            i = cuda.grid(1)
            if i < out.size:
                out[i] = twice(x[i]) * scale
        return kernel

    kernel = make(float(sys.argv[1]))
    out = cuda.device_array(100, np.float32)
    kernel[1, 128](out, cuda.to_device(np.arange(100, dtype=np.float32)))
    print(json.dumps({"out": out.copy_to_host().tolist(), "hits": sum(kernel.dispatcher._cache_hits.values()),
                      "misses": sum(kernel.dispatcher._cache_misses.values())}))
""")


def _run(tmp_path, scale: float) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(scale)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_kernel_the_first_compiled(tmp_path):
    first = _run(tmp_path, 3.0)
    assert (first["hits"], first["misses"]) == (0, 1)
    assert list((tmp_path / "strata" / "kernels").glob("*.kernel"))
    second = _run(tmp_path, 3.0)
    assert (second["hits"], second["misses"]) == (1, 0)
    assert second["out"] == first["out"] == [6.0 * i for i in range(100)]
    other = _run(tmp_path, 5.0)  # another value in the kernel's closure: another kernel
    assert (other["hits"], other["misses"]) == (0, 1) and other["out"][1] == 10.0


REAL = textwrap.dedent("""
    import json
    import numpy as np
    from numba import cuda
    from strata.bench.kernels import random_packed
    from strata.gpu.kernels import gemv_native
    from strata.gpu.kernels.gemv import gemv

    # the decode GEMV through the linked C++ rows (cffi pointers, an on-demand instantiation), fused norm
    rng = np.random.default_rng(11)
    w = random_packed("Q4_K", 1024, 2048, rng)
    assert gemv_native.is_supported(w)
    x = cuda.to_device(rng.standard_normal(2048).astype(np.float32))
    norm = cuda.to_device(rng.uniform(0.5, 1.5, 2048).astype(np.float32))
    y = gemv(w, x, norm_weight=norm, native=True)
    kernel = gemv_native._gemv_kernel("Q4_K", 2048, gemv_native.LAYER_CONFIG._replace(blocks_per_sm=0), True,
                                      False, 1)
    print(json.dumps({"y": y.copy_to_host().view(np.uint32).tolist(),
                      "hits": sum(kernel.dispatcher._cache_hits.values()),
                      "misses": sum(kernel.dispatcher._cache_misses.values())}))
""")


def test_a_real_decode_gemv_loaded_from_the_cache_gives_the_same_bits(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def run() -> dict:
        done = subprocess.run([sys.executable, "-c", REAL], capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert (first["hits"], first["misses"]) == (0, 1) and (second["hits"], second["misses"]) == (1, 0)
    assert second["y"] == first["y"]  # bit for bit
