"""A real uvicorn server on a loopback port, in a background thread, around the serve app."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from gguf import GGMLQuantizationType as QType

from strata.config import parse_config
from strata.model.synth import PRESETS, write_synthetic_model
from strata.serve.app import create_app
from strata.serve.server import ServeServer


def write_tiny_model(directory: Path) -> Path:
    return write_synthetic_model(directory / "tiny.gguf", PRESETS["tiny"], QType.Q8_0, seed=7)


def engine_loader(config, wrap=None):
    """``Engine.load`` as the server calls it; ``wrap`` puts a test wrapper around the real engine."""
    from strata.engine.facade import Engine

    def load():
        engine = Engine.load(config, show_progress=False)
        return wrap(engine) if wrap else engine

    return load


def make_config(model_path: Path, **sections):
    data = {"model": {"path": str(model_path)},
            "runtime": {"backend": "numpy", "serve": True, "context_tokens": 1024, "vram_budget": "512MiB"}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data)


class RunningServer:
    def __init__(self, engine_loader, config):
        self.app = create_app(engine_loader, config)
        self.server = ServeServer(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_config=None,
                                                 timeout_graceful_shutdown=2), self.app.state.serve)
        self._thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.url = ""

    @property
    def state(self):
        return self.app.state.serve

    def __enter__(self) -> RunningServer:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/health").status_code == 200:
                return
            if self.state.load_error:
                raise RuntimeError(self.state.load_error)
            time.sleep(0.02)
        raise RuntimeError("the model did not load in time")

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Shut down as SIGINT or SIGTERM would; whether the server thread ended within ``timeout_s``."""
        self.server.should_exit = True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        self.stop()



def openai_client(server: RunningServer, api_key: str = "unused"):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=30)


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response, checking its status and shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def sse_events(text: str) -> list:
    """The data payloads of an event stream, checking the framing; "[DONE]" stays a string."""
    assert text.endswith("\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values



class ControlledEngine:
    """The real engine behind a gate (``generate`` waits for ``gate``), optionally paced (a pause
    per token) or failing after some tokens, so that a test can hold the engine busy, cut a stream
    at a known point or break decode halfway."""

    def __init__(self, engine):
        self._engine = engine
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.pace_s = 0.0
        self.fail_after_tokens = 0
        self.failure: Exception | None = None  # raised by the next generate

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt_tokens, params, is_cancelled=lambda: False):
        self.entered.set()
        if not self.gate.wait(30):
            raise RuntimeError("the test never opened the gate")
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure
        return _Controlled(self._engine.generate(prompt_tokens, params, is_cancelled), self.pace_s,
                           self.fail_after_tokens)


class _Controlled:
    def __init__(self, generation, pace_s: float, fail_after_tokens: int):
        self._generation = generation
        self._pace_s = pace_s
        self._fail_after_tokens = fail_after_tokens

    @property
    def stats(self):
        return self._generation.stats

    def close(self):
        self._generation.close()

    def __iter__(self):
        events = iter(self._generation)
        try:
            for num_tokens, event in enumerate(events, 1):
                time.sleep(self._pace_s)
                yield event
                if num_tokens == self._fail_after_tokens:
                    raise RuntimeError("injected decode failure")
        finally:
            events.close()


FAULT_PLUGIN = """
from strata.hooks import hookimpl

ARMED = []  # one entry per planned failure


@hookimpl
def strata_prefill_release(ctx):
    return [name for name in ("output_head",) if name in ctx.resources]


@hookimpl
def strata_planner_budget(ctx, budget):
    if ARMED:
        ARMED.pop()
        raise RuntimeError("injected failure after the loan released its resources")
    return None
"""


def install_fault_plugin(root: Path, monkeypatch) -> str:
    """A loan plugin, installed through a real entry point, that fails the next loan when armed."""
    import importlib

    (root / "strata_serve_faults.py").write_text(FAULT_PLUGIN)
    info = root / "strata_serve_faults-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: strata-serve-faults\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[strata.plugins]\nserve_faults = strata_serve_faults\n")
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    return "serve_faults"
