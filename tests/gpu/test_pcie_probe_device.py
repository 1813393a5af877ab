"""The load's PCIe probe on the real device: every copy timed, and a rate a PCIe or C2C link can have."""

import pytest

from strata.engine.planning.rates import pcie_rate
from strata.gpu.pcie_probe import REPEATS, SIZES_BYTES, probe_host_to_device

pytestmark = pytest.mark.gpu


def test_the_probe_times_every_copy_and_measures_a_plausible_pinned_rate():
    samples = probe_host_to_device()
    assert [b for b, _ in samples] == [size for size in SIZES_BYTES for _ in range(REPEATS)]
    assert all(0 < seconds < 1 for _, seconds in samples)
    by_size = {size: min(s for b, s in samples if b == size) for size in SIZES_BYTES}
    assert by_size[SIZES_BYTES[0]] < by_size[SIZES_BYTES[-1]]  # more bytes take longer
    assert 1e9 < pcie_rate(samples) < 1e12  # PCIe 3.0 x4 to NVLink-C2C
