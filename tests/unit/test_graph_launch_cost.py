"""tools/graph_launch_cost.py: the host's cost of a graph replay, untraced (it times on a GPU; here, that it
says so instead of timing the simulator, and refuses what it cannot parse)."""

import pytest
from numba import config as numba_config
from project_tools import load_tool


def _tool():
    return load_tool("graph_launch_cost")


@pytest.mark.skipif(not numba_config.ENABLE_CUDASIM, reason="the simulator's refusal (on a GPU the tool times)")
def test_without_a_gpu_it_says_so_and_fails(capsys):
    assert _tool().main(["--nodes", "4"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--nodes", "many"], ["--nodes", "0"], ["--kernel-us", "-1"], ["--queued", "1"]])
def test_an_argument_it_cannot_parse_or_run_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _tool().main(argv)
    assert exit_info.value.code == 2 and argv[0] in capsys.readouterr().err
