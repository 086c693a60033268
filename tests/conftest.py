from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

# Ranks (forked or spawned) unpickle worker functions by module name: keep tests/ importable in every process.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def crasher() -> Iterator[Any]:
    """The crash tests' helper interpreter (:class:`crash_helpers.Crasher`), started once."""
    from crash_helpers import Crasher

    with Crasher() as c:
        yield c
