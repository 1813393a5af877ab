"""Why the tensor-core kernels are off is said, with the fix: a GPU without cffi silently ran the slow twins."""

import logging
import sys
import types

import numba
import pytest

from strata.backend import cuda_ops as ops_cuda
from strata.gpu.kernels import tensor_core


def _fake_gpu(monkeypatch, capability):
    device = types.SimpleNamespace(compute_capability=capability)
    fake_cuda = types.SimpleNamespace(is_available=lambda: True, get_current_device=lambda: device)
    monkeypatch.setattr(tensor_core, "IS_SIMULATOR", False)
    monkeypatch.setattr(numba, "cuda", fake_cuda)


def test_a_hopper_gpu_without_cffi_names_cffi_and_the_install(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "cffi", None)  # import cffi raises ImportError
    reason = tensor_core.unavailable_reason.__wrapped__()
    assert "cffi is not installed" in reason and "strata[gpu]" in reason


def test_an_old_gpu_names_its_compute_capability(monkeypatch):
    _fake_gpu(monkeypatch, (7, 5))
    assert "(7, 5)" in tensor_core.unavailable_reason.__wrapped__()


def test_a_hopper_gpu_with_cffi_runs_the_tensor_cores(monkeypatch):
    _fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "cffi", types.ModuleType("cffi"))
    assert tensor_core.unavailable_reason.__wrapped__() is None


def test_the_simulator_says_it_runs_the_twins():
    if not tensor_core.IS_SIMULATOR:
        pytest.skip("the simulator's reason")
    assert "simulator" in tensor_core.unavailable_reason()


def test_the_cuda_backend_warns_with_the_reason(monkeypatch, caplog):
    monkeypatch.setattr(tensor_core, "unavailable_reason", lambda: "cffi is not installed; install it")
    with caplog.at_level(logging.WARNING, logger=ops_cuda.__name__):
        ops_cuda._warn_without_tensor_cores()
    assert "tensor-core kernels are off: cffi is not installed" in caplog.text


def test_no_warning_when_the_tensor_cores_run(monkeypatch, caplog):
    monkeypatch.setattr(tensor_core, "unavailable_reason", lambda: None)
    with caplog.at_level(logging.WARNING, logger=ops_cuda.__name__):
        ops_cuda._warn_without_tensor_cores()
    assert caplog.text == ""
