"""Backend selection: ``runtime.backend`` → the ops implementation the engine runs on."""

from __future__ import annotations

from strata.backend.ops import Ops
from strata.config import Config
from strata.errors import ConfigError
from strata.gpu.ledger import VramLedger


def select_backend(config: Config) -> str:
    """The backend name for ``runtime.backend``; ``auto`` is cuda when a GPU is present, else numpy.
    Naming a GPU backend needs no GPU (``strata check`` plans for one elsewhere); running it does:
    see ``require_runnable``."""
    wanted = config.runtime.backend
    if wanted != "auto":
        return wanted
    return "cuda" if has_cuda_device() else "numpy"


def require_runnable(name: str, device: int) -> None:
    """A ConfigError naming the key and the fix unless backend ``name`` can run on this machine."""
    if name not in ("cuda", "cudasim"):
        return
    from numba import config as numba_config

    if name == "cudasim" and not numba_config.ENABLE_CUDASIM:
        raise ConfigError("runtime.backend = 'cudasim' runs the kernels in Numba's CUDA simulator, which must be "
                          "switched on before start: set NUMBA_ENABLE_CUDASIM=1 in the environment")
    if name == "cuda" and numba_config.ENABLE_CUDASIM:
        raise ConfigError("runtime.backend = 'cuda' but NUMBA_ENABLE_CUDASIM=1 is set; unset it, or use "
                          "runtime.backend = 'cudasim'")
    if name == "cuda":
        num_devices, reason = visible_cuda_devices()
        if not num_devices:
            raise ConfigError(f"runtime.backend = 'cuda' but no CUDA GPU is usable here ({reason}); set "
                              'runtime.backend = "auto" (numpy without a GPU) or "numpy"')
        if device >= num_devices:
            raise ConfigError(f"runtime.device = {device} but {num_devices} CUDA device(s) are visible (ordinals "
                              f"0..{num_devices - 1}); set runtime.device below {num_devices}")


def visible_cuda_devices() -> tuple[int, str]:
    """(number of CUDA devices this process can use, why none when it is 0)."""
    try:
        from numba import cuda

        if not cuda.is_available():
            return 0, "the CUDA driver reports no usable device"
        return len(cuda.gpus), ""
    except Exception as exc:  # noqa: BLE001 -- no driver, no toolkit: the reason goes into the message
        return 0, " ".join(str(exc).split())[:200] or type(exc).__name__


def make_ops(name: str, ledger: VramLedger, device: int = 0) -> Ops:
    if name == "numpy":
        from strata.backend.numpy_ops import NumpyOps

        return NumpyOps(ledger)
    if name in ("cuda", "cudasim"):
        require_runnable(name, device)
        try:
            from strata.backend.cuda_ops import CudaOps
        except ImportError as exc:
            raise ConfigError(f"runtime.backend = {name!r} is not available in this build ({exc}); "
                              'use runtime.backend = "numpy"') from exc
        return CudaOps(ledger, device=device, is_simulator=name == "cudasim")
    raise ConfigError(f"runtime.backend = {name!r}: allowed values are 'auto', 'cuda', 'cudasim', 'numpy'")


def has_cuda_device() -> bool:
    try:
        from numba import config as numba_config
        from numba import cuda

        return not numba_config.ENABLE_CUDASIM and bool(cuda.is_available())
    except Exception:  # no driver, no toolkit: the CPU it is
        return False
