"""The ``Examples::`` in the docstrings of the three calls a user starts from run as written
(doctest), so the documentation cannot drift from the code."""

from __future__ import annotations

import doctest
import io

import pytest

from lightning_remat.lightning.batch_size import find_max_batch_size
from lightning_remat.lightning.strategy import RematStrategy
from lightning_remat.planner import remat

DOCUMENTED = {"remat": remat, "RematStrategy": RematStrategy, "find_max_batch_size": find_max_batch_size}


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_docstring_examples_run(name: str) -> None:
    documented = DOCUMENTED[name]
    tests = doctest.DocTestFinder(recurse=False).find(documented, name)
    examples = sum(len(t.examples) for t in tests)
    assert examples >= 3, f"{name}'s docstring has no Examples:: section with >>> lines"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    for test in tests:
        runner.run(test, out=report.write)
    assert runner.failures == 0, f"{name}'s Examples:: no longer run as written:\n{report.getvalue()}"
