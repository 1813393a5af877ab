import numpy as np
from numba import cuda

from strata.gpu.compile_events import CompileCounter


def test_a_new_kernel_counts_and_its_second_launch_does_not():
    @cuda.jit
    def add_one(out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] += 1

    out = cuda.to_device(np.zeros(64, np.int32))
    counter = CompileCounter().listen()
    try:
        add_one[1, 64](out)
        compiled = counter.tally
        add_one[1, 64](out)
        again = counter.tally.since(compiled)
    finally:
        counter.close()
    assert compiled.num_compiles >= 1 and compiled.seconds > 0  # typing, lowering and linking may each take the lock
    assert again.num_compiles == 0
    assert any(name.startswith("test_a_new_kernel_counts_and_its_second_launch_does_not.<locals>.add_one(")
               for name in compiled.names), compiled.names
    assert (out.copy_to_host() == 2).all()
