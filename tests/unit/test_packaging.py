"""`pip install .` (not editable) carries every file the package reads at run time: each CUDA C++
source a kernel module names, each header those sources include, and every other file under strata/.

The wheel is built from a copy of the tree (`pip wheel --no-build-isolation`, offline). Where the
installed setuptools has no `bdist_wheel` (older setuptools without the `wheel` package), the copy's
`build_py` output is listed instead: it is what bdist_wheel packs for a pure-Python project.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "strata"
CUDA_DIR = PACKAGE / "gpu" / "kernels" / "cuda"
_SOURCE_NAME = re.compile(r"[\w.]+\.cuh?")
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_BUILD_TIMEOUT_S = 120


def named_sources() -> set[str]:
    """File names under kernels/cuda/ that the package's code names as string constants
    (`tensor_core.declare(..., "gemm_mma.cu")`), with the local headers they include, transitively."""
    names = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _SOURCE_NAME.fullmatch(node.value):
                names.add(node.value)
    pending = sorted(names)
    while pending:
        source = CUDA_DIR / pending.pop()
        for included in _LOCAL_INCLUDE.findall(source.read_text(encoding="utf-8")) if source.is_file() else ():
            if included not in names:
                names.add(included)
                pending.append(included)
    return names


def package_files(root: Path) -> set[str]:
    """Paths (relative to `root`, POSIX) of the files under root/strata that belong in the wheel."""
    return {path.relative_to(root).as_posix() for path in (root / "strata").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts and not path.name.startswith(".")
            and path.suffix != ".pyc"}


def built_files(source_root: Path, scratch: Path) -> set[str]:
    """The files `pip install` of `source_root` would put in site-packages, from a wheel built offline."""
    scratch.mkdir(parents=True)
    if _has_bdist_wheel():
        command = [sys.executable, "-m", "pip", "wheel", str(source_root), "--no-deps", "--no-build-isolation",
                   "--no-index", "--disable-pip-version-check", "-q", "-w", str(scratch)]
        _run(command, source_root)
        (wheel,) = scratch.glob("strata-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            return {name for name in archive.namelist() if not name.endswith("/")}
    _run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "--build-lib",
          str(scratch)], source_root)
    return {path.relative_to(scratch).as_posix() for path in scratch.rglob("*") if path.is_file()}


def _has_bdist_wheel() -> bool:
    return any(importlib.util.find_spec(name) for name in ("wheel", "setuptools.command.bdist_wheel"))


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"{' '.join(command[:6])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def copy_project(dest: Path) -> Path:
    """The files a build reads: pyproject.toml, the readme it names, the package (no caches)."""
    dest.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    shutil.copytree(PACKAGE, dest / "strata", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def missing_kernel_sources(files: set[str]) -> list[str]:
    return sorted(f"strata/gpu/kernels/cuda/{name}" for name in named_sources()
                  if f"strata/gpu/kernels/cuda/{name}" not in files)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("wheel")
    return built_files(copy_project(scratch / "project"), scratch / "built")


def test_kernel_modules_name_sources_that_exist():
    names = named_sources()
    # the parse found what the kernels load: at least the five linked sources and the shared header
    assert {"gemm_mma.cu", "attention_mma.cu", "moe_rows.cu", "gemv_rows.cu", "reduce.cu", "common.cuh",
            "iquants.cuh"} <= names
    assert sorted(name for name in names if not (CUDA_DIR / name).is_file()) == []


def test_wheel_carries_every_kernel_source_and_include(wheel_files):
    assert missing_kernel_sources(wheel_files) == []


def test_wheel_carries_every_package_file(wheel_files):
    assert sorted(package_files(REPO) - wheel_files) == []


def test_a_source_left_out_of_package_data_is_caught(tmp_path):
    project = copy_project(tmp_path / "project")
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    assert '"cuda/*.cuh"' in text
    pyproject.write_text(text.replace(', "cuda/*.cuh"', ""), encoding="utf-8")
    files = built_files(project, tmp_path / "built")
    headers = ("common.cuh", "iquants.cuh")
    assert missing_kernel_sources(files) == [f"strata/gpu/kernels/cuda/{name}" for name in headers]
