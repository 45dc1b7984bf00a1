"""Put the repository root first on sys.path: pytest's rootdir conftest puts tests/ there, and `import kernels` in a
spawned rank (which inherits sys.path) would otherwise find the tests/kernels folder as a namespace package."""
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path[:1]:
    sys.path.insert(0, ROOT)
