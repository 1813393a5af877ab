"""One loan-taker per GPU: a second process that can take loans on the same device refuses to start,
naming the first one's pid; the lock goes with its holder, also when the holder is killed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_harness import write_tiny_model

from strata.config import parse_config
from strata.engine.loading import claim_loan_device
from strata.errors import DeviceLockError
from strata.gpu.lock import hold_device_lock, lock_path, release_device_lock

REPO = Path(__file__).resolve().parents[2]
HOLD_SCRIPT = """
import sys, time
from strata.gpu.lock import hold_device_lock
from pathlib import Path
hold_device_lock(sys.argv[1], Path(sys.argv[2]), "stop it")
print("held", flush=True)
time.sleep(120)
"""


def loan_config(model: Path, lock_dir: Path, identity: str = "stand-in-gpu-0", is_loan: bool = True) -> str:
    return (f'[model]\npath = "{model}"\n[runtime]\nbackend = "numpy"\nserve = true\nvram_elastic = true\n'
            f'vmm_segment = "64MiB"\nvram_budget = "512MiB"\ncontext_tokens = 256\n'
            f'device_identity = "{identity}"\nlock_dir = "{lock_dir}"\n'
            f'[loan]\nenabled = {"true" if is_loan else "false"}\n'
            + ('plugins = ["repeat_loan"]\n' if is_loan else ""))


def strata(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("lock-model"))


def start_holder(identity: str, lock_dir: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, identity, str(lock_dir)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_loan_taker_on_the_gpu_refuses_to_start_naming_the_holder_and_starts_once_it_died(model, tmp_path):
    config = tmp_path / "loan.toml"
    config.write_text(loan_config(model, tmp_path / "locks"))
    # the first loan-taker: a server of this configuration (it holds the lock from before its dry run)
    first = subprocess.Popen([sys.executable, "-m", "strata.cli", "--config", str(config), "--port", "0"],
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    try:
        lock = lock_path("stand-in-gpu-0", tmp_path / "locks")
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip() == str(first.pid)):
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
            time.sleep(0.05)
        second = strata("--config", str(config), "generate", "--prompt", "hi", "--max-tokens", "1")
        assert second.returncode == 2, second.stderr
        assert f"process {first.pid} already takes prefill VRAM loans on GPU stand-in-gpu-0" in second.stderr
        assert "run this one on another GPU (runtime.device), or set loan.enabled = false" in second.stderr
        served = strata("--config", str(config), "--port", "0")  # a second server stops before binding
        assert served.returncode == 2 and f"process {first.pid} already takes" in served.stderr
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: the kernel drops the lock with the process
        first.wait(30)
    third = strata("--config", str(config), "generate", "--prompt", "hi", "--max-tokens", "1")
    assert third.returncode == 0, third.stderr


def test_another_gpu_or_a_configuration_without_the_loan_takes_no_lock_of_the_holder(model, tmp_path):
    holder = start_holder("stand-in-gpu-0", tmp_path)
    try:
        other_gpu = parse_config(_as_dict(model, tmp_path, identity="stand-in-gpu-1"))
        assert claim_loan_device(other_gpu, "numpy") == lock_path("stand-in-gpu-1", tmp_path)
        no_loan = parse_config(_as_dict(model, tmp_path, is_loan=False))
        assert claim_loan_device(no_loan, "numpy") is None
        same = parse_config(_as_dict(model, tmp_path))
        with pytest.raises(DeviceLockError, match=f"process {holder.pid} already takes"):
            claim_loan_device(same, "numpy")
    finally:
        holder.kill()
        holder.wait(30)
        release_device_lock(lock_path("stand-in-gpu-1", tmp_path))


def test_the_lock_is_held_once_per_process_and_given_back(tmp_path):
    path = hold_device_lock("gpu-x", tmp_path, "fix")
    assert hold_device_lock("gpu-x", tmp_path, "fix") == path  # a second engine in the same process
    release_device_lock(path)
    holder = start_holder("gpu-x", tmp_path)  # given back: another process takes it
    holder.kill()
    holder.wait(30)


def test_numpy_and_cudasim_without_a_stand_in_identity_take_no_lock(model, tmp_path):
    data = _as_dict(model, tmp_path, identity="")
    assert claim_loan_device(parse_config(data), "numpy") is None


def _as_dict(model, lock_dir, identity="stand-in-gpu-0", is_loan=True):
    import tomllib

    return tomllib.loads(loan_config(model, lock_dir, identity, is_loan))
