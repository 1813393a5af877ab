import logging

import pytest
from serve_harness import RunningServer, engine_loader, make_config, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="session")
def server(tiny_model):
    """One ready server on the real engine for the tests that only send requests."""
    config = make_config(tiny_model)
    with RunningServer(engine_loader(config), config) as running:
        running.wait_ready()
        yield running


@pytest.fixture
def timing_lines(caplog):
    caplog.set_level(logging.INFO, logger="strata.serve")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "strata.serve" and " prompt " in r.getMessage()]
