"""Expert staging's driver calls on the real device: batched and one-by-one DMAs on the copy
stream land the same bytes, and the events order them with the default stream's kernels."""

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _scattered_copies(cuda, rng, num_copies: int):
    """A device array, pinned sources, and (destinations, sources, sizes) for ``num_copies`` DMAs of
    odd sizes to scattered offsets; the bytes the device should hold after them."""
    num_bytes = (num_copies + 1) * 8192  # each copy in a span of its own, inside both buffers
    device = cuda.to_device(np.zeros(num_bytes, dtype=np.uint8))
    source = cuda.pinned_array(num_bytes, dtype=np.uint8)
    source[:] = rng.integers(0, 256, source.size, dtype=np.uint8)
    sizes = rng.integers(1, 4096, num_copies).astype(np.uint64)
    offsets = np.arange(num_copies, dtype=np.uint64) * 8192 + rng.integers(0, 64, num_copies).astype(np.uint64)
    expected = np.zeros(device.size, dtype=np.uint8)
    for offset, size in zip(offsets.tolist(), sizes.tolist()):
        expected[offset:offset + size] = source[offset:offset + size]
    base = np.uint64(device.device_ctypes_pointer.value)
    return device, source, (base + offsets, np.uint64(source.ctypes.data) + offsets, sizes), expected


@pytest.mark.parametrize("is_batched", [True, False])
def test_staged_copies_land_every_byte_on_the_copy_stream(is_batched, monkeypatch):
    from numba import cuda

    from strata.backend.expert_arena import CopyStream, HostToDeviceCopier
    from strata.gpu import driver_calls

    cuda.current_context()  # the driver calls act on the current context
    calls = driver_calls.load()
    if is_batched and not calls.can_copy_batch:
        pytest.skip("this driver has no cuMemcpyBatchAsync_v2")
    stream = CopyStream()
    copier = HostToDeviceCopier()
    copier.is_batch_usable = None if is_batched else False
    batch_calls = []
    copy_batch = calls.copy_batch
    monkeypatch.setattr(calls, "copy_batch", lambda *args: batch_calls.append(1) or copy_batch(*args))
    device, source, (destinations, sources, sizes), expected = _scattered_copies(cuda, np.random.default_rng(3), 300)
    cuda.synchronize()
    copier.copy(destinations, sources, sizes, stream.handle)
    done = calls.event_create()
    calls.event_record(done, stream.handle)
    calls.event_synchronize(done)
    assert copier.is_batch_usable is is_batched and bool(batch_calls) == is_batched
    assert np.array_equal(device.copy_to_host(), expected)


def test_a_kernel_after_wait_reads_the_staged_bytes():
    from numba import cuda

    from strata.backend.expert_arena import CopyStream

    @cuda.jit
    def total(values, out):
        i = cuda.grid(1)
        if i < values.size:
            cuda.atomic.add(out, 0, np.uint64(values[i]))

    class OneRange:  # stage() hands the copies to stage_many; here they are the prepared DMAs
        def __init__(self, copies):
            self.copies = copies

        def stage_many(self, slots, host_slots, stream):
            from strata.backend.expert_arena import HostToDeviceCopier

            HostToDeviceCopier().copy(*self.copies, stream)

    cuda.current_context()
    stream = CopyStream()
    device, _, copies, expected = _scattered_copies(cuda, np.random.default_rng(4), 200)
    out = cuda.to_device(np.zeros(1, dtype=np.uint64))
    cuda.synchronize()
    ticket = stream.stage(OneRange(copies), [0], [None])
    stream.wait(ticket)
    total[(device.size + 255) // 256, 256](device, out)  # legacy default stream, after the copies
    assert int(out.copy_to_host()[0]) == int(expected.sum(dtype=np.uint64))
