from __future__ import annotations

import os
import sys

# Spawned ranks unpickle worker functions by module name: keep tests/ importable in every process.
sys.path.insert(0, os.path.dirname(__file__))
