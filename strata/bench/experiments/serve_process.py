"""A ``strata serve`` process for an experiment: started on a free loopback port with its log in
the results folder, asked over HTTP (the standard library's client), stopped as SIGINT stops it."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from strata.errors import ExperimentError

HOST = "127.0.0.1"
STOP_TIMEOUT_S = 60


class ServeProcess:
    def __init__(self, config_path: Path, log_path: Path, load_timeout_s: float):
        self.config_path = config_path
        self.log_path = log_path
        self.load_timeout_s = load_timeout_s
        self.url = ""
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        port = _free_port()
        self.url = f"http://{HOST}:{port}"
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "strata.cli", "--config", str(self.config_path), "serve", "--host", HOST,
                 "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int | None:
        """SIGINT, as a user's Ctrl-C, then a kill after STOP_TIMEOUT_S; the exit status."""
        process = self._process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(signal.SIGINT)
        try:
            return process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def get(self, path: str, timeout_s: float = 30) -> tuple[int, str]:
        return self._exchange(urllib.request.Request(self.url + path), timeout_s)

    def post_json(self, path: str, body: dict, timeout_s: float) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        status, text = self._exchange(request, timeout_s)
        try:
            return status, json.loads(text)
        except ValueError:
            return status, {"error": {"message": text[:500]}}

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name (labels included in the name)."""
        status, text = self.get("/metrics")
        if status != 200:
            raise ExperimentError(f"GET /metrics answered {status}: {text[:300]}")
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-num_chars:]

    def _exchange(self, request: urllib.request.Request, timeout_s: float) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:  # the server is gone or did not answer in time
            return 0, f"no answer from the server: {exc}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.load_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ExperimentError(f"strata serve exited with status {self._process.returncode} before it was "
                                      f"ready (log: {self.log_path}):\n{self.log_tail()}")
            status, _ = self.get("/health", timeout_s=5)
            if status == 200:
                return
            time.sleep(0.2)
        raise ExperimentError(f"strata serve was not ready within --timeout {self.load_timeout_s:g} s "
                              f"(log: {self.log_path}); raise --timeout")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]
