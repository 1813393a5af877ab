import sys
from pathlib import Path

# Shared fakes and helpers live beside this file (tests/support); test modules import them by name.
sys.path.insert(0, str(Path(__file__).parent / "support"))
