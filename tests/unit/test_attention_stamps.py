"""tools/attention_stamps.py: the direct decode attention's phases stamped in a copy of its source (the harness
itself runs on a GPU with nvcc; here, that the kernel as it stands still has every anchor the tool stamps at)."""

import pytest
from project_tools import load_tool


def _tool():
    return load_tool("attention_stamps")


def test_every_phase_of_the_kernel_as_it_stands_is_stamped():
    tool = _tool()
    source = (tool.KERNELS / "attention_decode.cu").read_text()
    stamped = tool.instrument(source)
    for phase in (0, 1, 2, 3, 4, 5, 6, 7, 14, 15):
        assert f"STAMP({phase});" in stamped
    assert stamped.count("#define STAMP(i)") == 1 and "STAMP(" not in source


def test_a_kernel_without_an_anchor_names_the_tool_to_update():
    tool = _tool()
    source = (tool.KERNELS / "attention_decode.cu").read_text().replace("  if (!last) return;\n", "")
    with pytest.raises(ValueError, match="update tools/attention_stamps.py"):
        tool.instrument(source)


def test_without_nvcc_it_says_so(capsys):
    assert _tool().main(["--nvcc", "/nonexistent/nvcc"]) == 2
    assert "no nvcc at '/nonexistent/nvcc'" in capsys.readouterr().err


def test_the_harness_runs_under_the_wrapping_command(tmp_path, monkeypatch, capfd):
    # the profiler's command line comes first, the built harness last (here a script standing in for both)
    tool = _tool()
    harness = tmp_path / "harness"
    harness.write_text("#!/bin/sh\necho harness ran\n")
    harness.chmod(0o755)
    monkeypatch.setattr(tool, "build", lambda source, folder, nvcc: harness)
    monkeypatch.setattr(tool.shutil, "which", lambda name: name)
    assert tool.main(["--nvcc", "nvcc", "--wrap", "sh -c 'echo wrapped \"$0\"; exec \"$0\"'"]) == 0
    out = capfd.readouterr().out
    assert f"wrapped {harness}\nharness ran\n" in out


def test_a_wrapping_command_it_cannot_run_is_named(monkeypatch, capsys):
    tool = _tool()
    monkeypatch.setattr(tool.shutil, "which", lambda name: None if name == "nonexistent-profiler" else name)
    assert tool.main(["--nvcc", "nvcc", "--wrap", "nonexistent-profiler --x"]) == 2
    assert "--wrap names 'nonexistent-profiler', which is not on PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # unbalanced quotes: argparse's error, naming the option
        tool.main(["--nvcc", "nvcc", "--wrap", "ncu 'oops"])
    assert "--wrap \"ncu 'oops\": No closing quotation" in capsys.readouterr().err
