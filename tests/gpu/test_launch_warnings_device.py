import warnings

import numpy as np
from numba import cuda

from strata.backend.cuda_ops import quiet_launch_warnings


def test_a_one_block_launch_does_not_even_call_warn():
    @cuda.jit
    def one(out):
        out[0] = 1

    quiet_launch_warnings()
    out = cuda.device_array(1, np.int32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # a filter cannot hide it: the check itself must be off
        one[1, 32](out)
    cuda.synchronize()
    assert out.copy_to_host()[0] == 1
    assert [str(w.message) for w in seen if "Grid size" in str(w.message)] == []
