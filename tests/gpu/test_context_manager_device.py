"""A process's CUDA context made by a helper before the engine (the serve command's dry run probes
PCIe first) must carry the ledger's memory manager: otherwise the engine loaded next cannot capture
decode graphs and decodes ~10x slower. Each case runs in a fresh process, where no context exists."""

import os
import subprocess
import sys

import pytest

FIRST_USES = {
    "pcie probe": "from strata.gpu.pcie_probe import probe_host_to_device; probe_host_to_device()",
    "free memory": "from strata.gpu.device import free_device_bytes; free_device_bytes()",
    "used memory": "from strata.gpu.device import used_device_bytes; used_device_bytes()",
    "device identity": "from strata.gpu.device import device_uuid; device_uuid()",
    "tensor-core check": "from strata.gpu.kernels.tensor_core import is_available; is_available()",
}
ENGINE_OPS = """
from strata.backend.select import make_ops
from strata.gpu.ledger import VramLedger
ops = make_ops("cuda", VramLedger(1 << 30))
print("capture", ops.can_capture)
"""


@pytest.mark.parametrize("first_use", sorted(FIRST_USES))
def test_the_engine_after_a_helper_made_the_context_captures_decode(first_use):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", FIRST_USES[first_use] + "\n" + ENGINE_OPS], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["capture", "True"]
    assert "made its CUDA context before the engine" not in done.stderr

SERVE_LOADS = """
import sys
from strata.config import load_config
from strata.engine.facade import Engine
config = load_config(sys.argv[1])
Engine.load(config, show_progress=False, is_dry_run=True).close()  # as `strata serve` checks before binding
engine = Engine.load(config, show_progress=False)
print("capture", engine.runner.can_pick_greedy_on_device)
engine.close()
"""


def test_a_served_engine_after_its_dry_run_captures_decode(tmp_path):
    from engine_setup import write_small_moe

    model = write_small_moe(tmp_path / "small.gguf")
    config = tmp_path / "cuda.toml"
    config.write_text(f'[model]\npath = "{model}"\n[runtime]\nbackend = "cuda"\nvram_budget = "64MiB"\n'
                      'vmm_segment = "2MiB"\ncontext_tokens = 1024\nwarmup = false\n')
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", SERVE_LOADS, str(config)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["capture", "True"]
