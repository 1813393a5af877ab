"""Small launch grids must not warn: numba-cuda checks every launch, and a serving process's
frameworks reset the warnings registry (``warnings.catch_warnings``) often enough that a filter
alone let each small decode launch format a warning again."""

import os
import subprocess
import sys

CODE = """
import warnings
from strata.backend.cuda_ops import quiet_launch_warnings
quiet_launch_warnings()
from numba.core.errors import NumbaPerformanceWarning
from numba.cuda import dispatcher
from numba.cuda.core.errors import NumbaPerformanceWarning as CudaPerformanceWarning
with warnings.catch_warnings(record=True) as seen:  # a registry reset, as a web framework's
    for category in (NumbaPerformanceWarning, CudaPerformanceWarning):
        warnings.warn(category("Grid size 1 will likely result in GPU under-utilization due to low occupancy."))
print(dispatcher.config.CUDA_LOW_OCCUPANCY_WARNINGS, len(seen))
"""


def test_the_occupancy_check_is_off_and_numba_cudas_own_warning_class_is_filtered():
    # without the simulator: the real dispatcher module and its config
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0"]
