import pytest


def pytest_collection_modifyitems(config, items):
    from strata.backend.select import has_cuda_device

    if has_cuda_device():
        return
    skip = pytest.mark.skip(reason="needs a real CUDA device (not the simulator)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
