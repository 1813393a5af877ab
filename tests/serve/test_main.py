"""``strata --config FILE``: the main job from the command line."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import uvicorn
from serve_harness import make_config

from strata.cli import main
from strata.serve.main import build_server


def write_config(path, model, runtime="", loan="", context_tokens=512):
    path.write_text(f'[model]\npath = "{model}"\n\n[runtime]\nbackend = "numpy"\nserve = true\n'
                    f'context_tokens = {context_tokens}\n'
                f'vram_budget = "512MiB"\n'
                    f'{runtime}\n[serve]\nport = 0\n{loan}')
    return path


@pytest.fixture
def no_binding(monkeypatch):
    async def startup(self, sockets=None):
        raise AssertionError("the server bound a port")

    monkeypatch.setattr(uvicorn.Server, "startup", startup)


def test_admission_failure_exits_before_binding(tiny_model, tmp_path, capsys, no_binding):
    config = write_config(tmp_path / "alias.toml", tiny_model,
                          runtime="vram_elastic = true\nprefill_head_alias = true\n",
                          loan='[loan]\nenabled = true\nplugins = ["repeat_loan"]\n')
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "not admitted" in err and "runtime.prefill_head_alias" in err
    assert "set runtime.prefill_head_alias = false" in err


def test_a_feature_strata_does_not_have_is_refused_before_binding_whatever_the_loan(tiny_model, tmp_path, capsys,
                                                                                   no_binding):
    config = write_config(tmp_path / "batch.toml", tiny_model, runtime="batch_slots = 4\n")
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "runtime.batch_slots = 4: concurrent batch sessions" in err and "not supported by Strata" in err


def test_a_config_without_serve_is_refused(tiny_model, tmp_path, capsys, no_binding):
    config = write_config(tmp_path / "off.toml", tiny_model)
    config.write_text(config.read_text().replace("serve = true", "serve = false"))
    assert main(["--config", str(config)]) == 2
    assert "runtime.serve = false" in capsys.readouterr().err


def test_strata_config_serves_until_interrupted_mid_stream(tiny_model, tmp_path):
    config = write_config(tmp_path / "serve.toml", tiny_model, context_tokens=4096)
    # a job started in the background of a non-interactive shell inherits SIGINT ignored, and Python then
    # installs no handler for it: the server must see Ctrl-C as a terminal would deliver it
    process = subprocess.Popen([sys.executable, "-m", "strata.cli", "--config", str(config)], stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stderr), daemon=True)
    reader.start()
    try:
        url = _wait_for_url(lines, process)
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and process.poll() is None, "".join(lines)
            time.sleep(0.05)
        response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        events, exit_s = _interrupt_a_long_stream(url, process, _end_of_generation_ids(tiny_model))
        assert process.wait(30) == 130  # a graceful shutdown, then the shell's code for Ctrl-C
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    reader.join(10)
    log = "".join(lines)
    assert "placement on numpy" in log and "startup plan" in log and "Waiting for application shutdown" in log
    timing = [line for line in lines if request_id in line]
    assert len(timing) == 1 and "/v1/completions prompt " in timing[0] and "tok/s" in timing[0]
    assert events[-1] == "data: [DONE]" and '"code":"shutting_down"' in events[-2], events[-3:]
    assert exit_s < 1.0 and "Traceback" not in log and " ERROR " not in log, (exit_s, log[-3000:])


def _interrupt_a_long_stream(url, process, banned_ids) -> tuple[list[str], float]:
    """Ctrl-C after the third chunk of a stream that would run for seconds: (its data lines, the
    seconds from the signal to the process's exit)."""
    body = {"model": "tiny", "prompt": "Tell me everything", "max_tokens": 4000, "stream": True, "temperature": 0,
            "logit_bias": {str(token): -100 for token in banned_ids}}
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        for line in (line for line in response.iter_lines() if line.startswith("data: ")):
            events.append(line)
            if len(events) == 3:  # once: a second Ctrl-C forces the exit
                process.send_signal(signal.SIGINT)
                interrupted_at = time.monotonic()
    process.wait(30)
    return events, time.monotonic() - interrupted_at


def _end_of_generation_ids(model) -> list[int]:
    from strata.model.gguf_file import open_gguf
    from strata.model.tokenizer import Tokenizer

    return sorted(Tokenizer.from_metadata(open_gguf(model).metadata).eog_ids)


def _wait_for_url(lines, process) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", "".join(lines))
        if found:
            return found.group(1)
        assert process.poll() is None, "".join(lines)
        time.sleep(0.02)
    raise AssertionError("the server did not report its address:\n" + "".join(lines))


def test_a_failed_background_load_stops_the_server(tiny_model):
    config = make_config(tiny_model, serve={"port": 0})

    def broken():
        raise MemoryError("the expert pack does not fit in host memory")

    server = build_server(config, broken)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    assert "does not fit" in server.config.app.state.serve.load_error


@pytest.mark.parametrize("argv_tail, host, port", [
    (["--port", "8084"], None, 8084),
    (["--host", "0.0.0.0", "--port", "0"], "0.0.0.0", 0),
    (["serve", "--port", "9"], None, 9),
])
def test_serve_options_work_without_the_serve_word(tiny_model, tmp_path, monkeypatch, argv_tail, host, port):
    import strata.serve.main

    seen = {}
    monkeypatch.setattr(strata.serve.main, "run", lambda args, config: seen.update(vars(args)) or 0)
    config = write_config(tmp_path / "serve.toml", tiny_model)
    assert main(["--config", str(config), *argv_tail]) == 0
    assert (seen["command"], seen["host"], seen["port"]) == ("serve", host, port)


def test_a_misspelt_command_is_still_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "x.toml"), "chekc"])
    assert "invalid choice: 'chekc'" in capsys.readouterr().err


@pytest.fixture
def no_gpu(monkeypatch):
    from numba import config as numba_config

    import strata.backend.select
    import strata.gpu.kernels.launcher  # noqa: F401 (its launch path follows the simulator flag at import)
    import strata.gpu.kernels.quant_device  # noqa: F401 (likewise)

    monkeypatch.setattr(numba_config, "ENABLE_CUDASIM", 0)
    monkeypatch.setattr(strata.backend.select, "visible_cuda_devices",
                        lambda: (0, "CUDA driver library cannot be found"))


def test_cuda_without_a_gpu_exits_2_naming_the_key_and_the_fix(tiny_model, tmp_path, capsys, no_gpu, no_binding):
    config = write_config(tmp_path / "cuda.toml", tiny_model)
    config.write_text(config.read_text().replace('"numpy"', '"cuda"'))
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "runtime.backend = 'cuda' but no CUDA GPU is usable here (CUDA driver library cannot be found)" in err
    assert 'set runtime.backend = "auto"' in err and "Traceback" not in err


def test_check_plans_for_a_gpu_without_one_but_cannot_measure_its_memory(tiny_model, tmp_path, capsys, no_gpu):
    config = write_config(tmp_path / "cuda.toml", tiny_model)
    config.write_text(config.read_text().replace('"numpy"', '"cuda"'))
    assert main(["--config", str(config), "check"]) == 0  # runtime.vram_budget sizes the plan
    capsys.readouterr()
    config.write_text(config.read_text().replace('vram_budget = "512MiB"\n', ""))
    assert main(["--config", str(config), "check"]) == 2
    assert "runtime.backend = 'cuda' but no CUDA GPU is usable here" in capsys.readouterr().err


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a GPU is present")
def test_cuda_without_a_gpu_in_a_real_process(tiny_model, tmp_path):
    config = write_config(tmp_path / "cuda.toml", tiny_model).read_text().replace('"numpy"', '"cuda"')
    (tmp_path / "cuda.toml").write_text(config)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-m", "strata.cli", "--config", str(tmp_path / "cuda.toml"), "--port", "0"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "runtime.backend = 'cuda' but no CUDA GPU is usable here" in done.stderr and "Traceback" not in done.stderr


def test_cudasim_without_a_budget_exits_2(tiny_model, tmp_path, capsys, no_binding):
    config = write_config(tmp_path / "sim.toml", tiny_model)
    config.write_text(config.read_text().replace('"numpy"', '"cudasim"').replace('vram_budget = "512MiB"\n', ""))
    assert main(["--config", str(config)]) == 2
    assert 'runtime.backend = "cudasim" needs runtime.vram_budget' in capsys.readouterr().err


def test_the_servers_logging_leaves_numbas_cuda_driver_at_warnings():
    # in its own process, without the simulator: the real driver module makes its logger after
    # the server's root handler exists, as a serving process does at its first device call
    code = ("import logging; from strata.serve.main import configure_logging; configure_logging('debug'); "
            "from numba.cuda.cudadrv import driver; log = driver.make_logger(); "
            "print(log.isEnabledFor(logging.INFO), log.isEnabledFor(logging.WARNING), "
            "logging.getLogger('strata').isEnabledFor(logging.DEBUG))")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True"]
