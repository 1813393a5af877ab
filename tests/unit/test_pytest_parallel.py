"""tools/pytest_parallel.py: a selection dealt to several pytest processes, the first failure's status, and
pytest's 5 for a selection without tests."""

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "pytest_parallel.py"


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--jobs", "3", "--logs", str(folder / "logs"), *args],
                          capture_output=True, text=True, cwd=folder, timeout=120)


def test_every_test_runs_once_in_one_of_the_jobs_and_a_failure_fails_the_run(tmp_path):
    (tmp_path / "test_a.py").write_text("import os\nimport pytest\n\n@pytest.mark.parametrize('i', range(5))\n"
                                        "def test_ok(i):\n"
                                        "    open(f'ran-{i}', 'w').write(os.environ['XDG_RUNTIME_DIR'])\n")
    done = _run(tmp_path, "test_a.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in tmp_path.glob("ran-*")) == [f"ran-{i}" for i in range(5)]
    # each job its own runtime directory (the loan-taker lock's): ids i and i + 3 share the job
    runtime_dirs = [(tmp_path / f"ran-{i}").read_text() for i in range(5)]
    assert len(set(runtime_dirs)) == 3 and runtime_dirs[0] == runtime_dirs[3] and Path(runtime_dirs[0]).is_dir()
    assert done.stdout.count("passed") == 3  # the five dealt to three jobs
    done = _run(tmp_path, "-q", "test_a.py")  # the run's own -q does not hide the node ids from the dealing
    assert done.returncode == 0 and done.stdout.count("passed") == 3, done.stdout + done.stderr
    (tmp_path / "test_b.py").write_text("def test_bad():\n    assert False\n")
    done = _run(tmp_path, "test_a.py", "test_b.py")
    assert done.returncode == 1 and "1 failed" in done.stdout
    done = _run(tmp_path, "test_a.py", "-k", "test_bad")  # -k selects before the ids are dealt
    assert done.returncode == 5 and "no tests collected" in done.stderr
