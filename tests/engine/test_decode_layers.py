"""Decode sees the model through ``DecodeLayers``: the runner implements it, and the decode step
is built without importing the runner."""

import inspect
import subprocess
import sys

import pytest
from engine_setup import engine_config, write_small_moe

from strata.engine.decode.layers import DecodeLayers
from strata.engine.facade import Engine


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = write_small_moe(tmp_path_factory.mktemp("models") / "small-moe.gguf")
    return Engine.load(engine_config(path), show_progress=False).runner


def _protocol_members(kind) -> dict[str, object]:
    return {name: member for name, member in vars(DecodeLayers).items()
            if not name.startswith("_") and isinstance(member, kind)}


def _parameters(function) -> list[tuple]:
    """Names, kinds and defaults: what a call depends on (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_runner_has_every_method_of_the_interface_with_its_parameters(runner):
    methods = _protocol_members(type(_parameters))
    assert methods.keys() == {"attention_block", "matrix", "vector", "decode_slots", "prefetch"}
    for name, method in methods.items():
        assert _parameters(getattr(type(runner), name)) == _parameters(method), name


def test_the_runner_has_every_attribute_of_the_interface(runner):
    attributes = _protocol_members(property)
    assert attributes.keys() == {"spec", "ops", "kv", "cache", "pack", "token_embedding"}
    for name in attributes:
        assert getattr(runner, name) is not None, name
    assert runner.token_embedding is runner.w.matrices["token_embd"]


def test_the_decode_step_imports_without_the_runner():
    code = ("import sys, strata.engine.decode.step, strata.engine.decode.layers; "
            "sys.exit('strata.engine.runner' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
