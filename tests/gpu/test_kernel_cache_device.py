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
