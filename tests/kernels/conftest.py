import sys
from pathlib import Path

# kernel_data.py (seeded inputs shared by these tests) lives beside this file.
sys.path.insert(0, str(Path(__file__).parent))
