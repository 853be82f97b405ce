"""The ``Examples::`` in the docstrings of the three calls a user starts from, and the
README's examples, run as written, so the documentation cannot drift from the code."""

from __future__ import annotations

import contextlib
import doctest
import io
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_remat import remat
from lightning_remat.lightning.batch_size import find_max_batch_size
from lightning_remat.lightning.strategy import RematStrategy

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


README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.slow
def test_readme_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block of the README, in order and in one namespace (a later block uses
    what an earlier one defined), runs as written; Lightning writes its logs under tmp_path."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 3, "the README lost its remat(), strategy or batch-size example"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "readme"}
    for number, block in enumerate(blocks, 1):
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    assert namespace["model"].batch_size == namespace["report"].batch_size
