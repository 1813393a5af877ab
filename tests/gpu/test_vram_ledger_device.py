"""The ledger on real device memory (Numba's memory manager) and the VMM expert-cache storage.

Each test runs in a fresh subprocess: the memory manager must be installed before the process's
CUDA context exists, and the device's free-memory report is read without other allocations."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_numba_allocation_is_charged_and_agrees_with_the_device():
    out = run_python("""
        from strata.gpu.ledger import VramLedger
        from strata.gpu.memory import install_ledger, trim_pool
        from strata.errors import VramBudgetError
        ledger = VramLedger(4 << 30)
        install_ledger(ledger)
        from numba import cuda
        import numpy as np
        ctx = cuda.current_context()
        free0 = ctx.get_memory_info().free
        with ledger.owner("kv_cache"):
            a = cuda.device_array(256 << 20, dtype=np.uint8)
        with ledger.owner("dense_weights"):
            b = cuda.to_device(np.ones(64 << 20, dtype=np.uint8))
        used_device = free0 - ctx.get_memory_info().free
        print("by_owner", dict(ledger.snapshot().by_owner))
        assert dict(ledger.snapshot().by_owner) == {"dense_weights": 64 << 20, "kv_cache": 256 << 20}
        from strata.gpu import live_allocations  # each allocation carries its charge: its holders are found
        held = live_allocations.holders([c.charge_id for c in ledger.live_charges("kv_cache")])
        assert len(held) == 1 and held[0].startswith(f"{256 << 20} bytes: OwnedPointer"), held
        assert "DeviceNDArray (268435456,) uint8" in held[0], held
        # the device agrees within the driver's rounding (2 MiB pages)
        assert abs(used_device - (320 << 20)) <= 8 << 20, used_device
        try:
            with ledger.owner("expert_cache"):
                cuda.device_array(8 << 30, dtype=np.uint8)
            raise SystemExit("no budget error")
        except VramBudgetError as exc:
            assert "expert_cache asked for 8192.0 MiB" in str(exc) and "kv_cache=256.0 MiB" in str(exc), exc
        pointer = a.device_ctypes_pointer.value
        del a, b
        # freed blocks stay with the allocator's cache, charged as such, until trimmed or reused
        assert dict(ledger.snapshot().by_owner) == {"allocator_cache": 320 << 20}
        with ledger.owner("activations"):
            c = cuda.device_array(256 << 20, dtype=np.uint8)
        assert c.device_ctypes_pointer.value == pointer
        assert dict(ledger.snapshot().by_owner) == {"activations": 256 << 20, "allocator_cache": 64 << 20}
        del c
        # a charge that does not fit takes back what it needs from the cache, largest blocks first
        with ledger.owner("expert_cache"):
            d = cuda.device_array((4 << 30) - (64 << 20), dtype=np.uint8)
        assert dict(ledger.snapshot().by_owner) == {"allocator_cache": 64 << 20, "expert_cache": (4 << 30) - (64 << 20)}
        del d
        assert trim_pool(ledger) == 4 << 30
        assert dict(ledger.snapshot().by_owner) == {}
        assert abs(free0 - ctx.get_memory_info().free) <= 8 << 20
        print("ok")
    """)
    assert "ok" in out


def test_vmm_arena_grows_and_shrinks_by_segments_without_moving_experts():
    out = run_python("""
        import numpy as np
        from numba import cuda
        from strata.gpu.ledger import VramLedger
        from strata.gpu.vmm import VmmArena, allocation_granularity
        from strata.errors import ConfigError
        assert allocation_granularity(0) == 2 << 20
        ledger = VramLedger(8 << 30)
        seg = 64 << 20
        arena = VmmArena(ledger, "expert_cache", 1 << 30, seg)
        arena.map_segments(2 * seg)
        assert ledger.owner_bytes("expert_cache") == 2 * seg and arena.mapped_bytes == 2 * seg
        view = arena.array
        pattern = np.arange(seg, dtype=np.uint32).view(np.uint8)[:seg]
        view[:seg].copy_to_device(pattern)
        arena.map_segments(3 * seg)
        assert arena.mapped_bytes == 5 * seg and ledger.owner_bytes("expert_cache") == 5 * seg
        view[4 * seg:5 * seg].copy_to_device(pattern)
        arena.unmap_to(2 * seg)
        assert ledger.owner_bytes("expert_cache") == 2 * seg
        assert np.array_equal(view[:seg].copy_to_host(), pattern)  # never moved
        try:
            VmmArena(ledger, "x", 1 << 30, 3 << 20)
            raise SystemExit("granularity not checked")
        except ConfigError as exc:
            assert "multiple" in str(exc)
        arena.close()
        assert ledger.owner_bytes("expert_cache") == 0
        print("ok")
    """)
    assert "ok" in out
