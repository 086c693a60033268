"""Every docstring example in the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import shardsync

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(shardsync.__path__, "shardsync.") if not m.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


@pytest.mark.parametrize("name", MODULES)
def test_skipped_examples_show_no_output(name: str) -> None:
    # an example that never runs can never fail: it may illustrate a call, but not claim a result
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    claims = [
        f"{test.name}: {ex.source.strip()} -> {ex.want.strip()}"
        for test in finder.find(module)
        for ex in test.examples
        if ex.options.get(doctest.SKIP) and ex.want.strip()
    ]
    assert not claims, "skipped examples that show output:\n" + "\n".join(claims)
