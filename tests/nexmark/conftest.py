"""Makes the DuckDB reference of the core tests importable here."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "core"))
