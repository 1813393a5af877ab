"""``strata --config FILE [serve]``: the OpenAI-compatible HTTP server, the main job.

The port is bound first and the model loads in the background (``/health`` answers 503 until it
is ready), so a supervisor sees a live process during a long load. Configuration errors that need
no model, the loan's admission among them, are reported before anything binds.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from strata.config import Config
from strata.errors import ConfigError

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("strata.serve")
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="address to listen on (default: serve.host)")
    parser.add_argument("--port", type=int, help="TCP port (default: serve.port; 0 picks a free one)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="stderr log level (default info)")


def run(args: argparse.Namespace, config: Config) -> int:
    config = with_overrides(config, host=getattr(args, "host", None), port=getattr(args, "port", None))
    configure_logging(getattr(args, "log_level", "info"))
    if not config.runtime.serve:
        raise ConfigError("runtime.serve = false: this configuration does not enable the HTTP server; "
                          "set runtime.serve = true under [runtime]")
    from strata.backend.select import require_runnable, select_backend
    from strata.engine.facade import Engine
    from strata.engine.loading import claim_loan_device

    backend = select_backend(config)
    require_runnable(backend, config.runtime.device)  # the dry run below would not need it
    claim_loan_device(config, backend)  # a second loan-taker on this GPU stops here, before binding
    # a dry run charges the ledger without uploading or packing: admission and placement in seconds
    Engine.load(config, show_progress=False, is_dry_run=True).close()
    server = build_server(config, lambda: Engine.load(config, show_progress=True),
                          log_level=getattr(args, "log_level", "info"))
    server.run()
    state = server.config.app.state.serve
    if state.load_error:
        print(f"strata: error: {state.load_error}", file=sys.stderr)
        return 1
    return 0


def build_server(config: Config, engine_loader, *, log_level: str = "info") -> uvicorn.Server:
    """The server for the app; a failed load stops it so that ``run`` can exit non-zero."""
    import uvicorn  # imported here: the CLI's other commands run where no HTTP stack is installed

    from strata.serve.app import create_app
    from strata.serve.server import GRACEFUL_SHUTDOWN_S, ServeServer

    holder: dict[str, uvicorn.Server] = {}

    def load():
        try:
            return engine_loader()
        except BaseException:
            holder["server"].should_exit = True
            raise

    app = create_app(load, config)
    server = ServeServer(uvicorn.Config(app, host=config.serve.host, port=config.serve.port, log_level=log_level,
                                        log_config=None, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S),
                         app.state.serve)
    holder["server"] = server
    return server


def with_overrides(config: Config, **serve_fields) -> Config:
    changes = {k: v for k, v in serve_fields.items() if v is not None}
    if "port" in changes and not 0 <= changes["port"] <= 65535:
        raise ConfigError(f"--port {changes['port']} is not a TCP port (0..65535)")
    if not changes:
        return config
    return dataclasses.replace(config, serve=dataclasses.replace(config.serve, **changes))


def configure_logging(level: str) -> None:
    """Timing lines and startup messages go to stderr; uvicorn's own loggers share the handler.
    Numba's stay at warnings whatever the level: its CUDA driver logger, created after a root
    handler exists, takes the root's level, and at INFO it writes two records for every device
    array freed (thousands in a decode token) and at DEBUG one for every driver call."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("numba").setLevel(logging.WARNING)
