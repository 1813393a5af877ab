import gc
import sys
from pathlib import Path

import pytest

# Shared fakes and helpers live beside this file (tests/support); test modules import them by name.
sys.path.insert(0, str(Path(__file__).parent / "support"))


def pytest_sessionstart(session):
    """On a real GPU, install the ledger's memory manager before any test makes the CUDA context:
    a context made first by a kernel test would keep Numba's own manager, and the engines made in
    it later could not capture decode graphs (``CudaOps.can_capture``)."""
    from strata.backend.select import has_cuda_device

    if has_cuda_device():
        from strata.gpu.memory import install_ledger

        install_ledger(None)


@pytest.fixture(autouse=True)
def thaw_after_each_test():
    """A loaded engine freezes the interpreter's objects out of the collector and times its passes until it
    closes; an engine a test leaves open would keep the session's reference cycles uncollected and its
    callback called at every later pass."""
    yield
    gc.unfreeze()
    from strata.engine.collector import CollectorWatch

    gc.callbacks[:] = [cb for cb in gc.callbacks if not isinstance(getattr(cb, "__self__", None), CollectorWatch)]
