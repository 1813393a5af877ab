"""The code a benchmark names: a tracked package's commit, changes marked, a copy named as a copy."""

import shutil
import subprocess

import pytest

from strata.bench.provenance import code_identity

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(folder, *args) -> str:
    done = subprocess.run(["git", "-C", str(folder), "-c", "user.name=bench", "-c", "user.email=bench@example.org",
                           *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A git checkout with a tracked package and, in an ignored folder, a copy of it."""
    (tmp_path / "strata").mkdir()
    (tmp_path / "strata" / "__init__.py").write_text("")
    (tmp_path / ".gitignore").write_text("old/\n")
    (tmp_path / "old" / "strata").mkdir(parents=True)
    (tmp_path / "old" / "strata" / "__init__.py").write_text("")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "package")
    return tmp_path


def test_a_tracked_package_is_named_by_its_commit(checkout):
    commit = _git(checkout, "rev-parse", "--short", "HEAD")
    assert code_identity(checkout / "strata") == f"strata {commit} at {(checkout / 'strata').resolve()}"
    (checkout / "strata" / "__init__.py").write_text("VERSION = 2\n")
    assert code_identity(checkout / "strata").startswith(f"strata {commit}+changes at ")


def test_a_copy_is_not_named_by_the_checkout_around_it(checkout, tmp_path_factory):
    copy = checkout / "old" / "strata"
    assert code_identity(copy) == f"strata at {copy.resolve()} (not a git checkout)"
    outside = tmp_path_factory.mktemp("outside")
    assert code_identity(outside) == f"strata at {outside.resolve()} (not a git checkout)"
