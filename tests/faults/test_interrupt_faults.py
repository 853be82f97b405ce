"""Ctrl-C during planning leaves nothing behind: the memory meter's state and the modules
planning imports are as before, and the next ``remat()`` of the same module plans and
trains as plain PyTorch does."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.autograd import _profiler_enabled

from lightning_remat import remat
from lightning_remat.measure import allocations

ROOT = Path(__file__).resolve().parents[2]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())])


def _assert_trains_as_plain(model: nn.Module, plain: nn.Module, x: torch.Tensor) -> None:
    planned = remat(model, x, "80%")
    assert planned.plan.count("recompute") > 0
    planned(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("where, call", [
    ("_collect", 1),  # reading back the profiler's events, as the metered step's log exits
    ("mark", 1),  # the log's first mark, as it is entered
    ("mark", 2),  # the log's last mark, as it exits
])
def test_an_interrupt_inside_the_meter_leaves_it_as_before(monkeypatch, where, call):
    model, x = _net(), torch.randn(256, 64)
    plain = copy.deepcopy(model)
    original = getattr(allocations.AllocationLog, where)
    calls = []

    def interrupted(self, *args):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt  # Ctrl-C, here
        return original(self, *args)

    monkeypatch.setattr(allocations.AllocationLog, where, interrupted)
    with pytest.raises(KeyboardInterrupt):
        remat(model, x, "80%")
    monkeypatch.setattr(allocations.AllocationLog, where, original)
    assert allocations._running_logs == [] and not _profiler_enabled()  # no log left running
    assert all(p.grad is None for p in model.parameters())  # the module untouched
    _assert_trains_as_plain(model, plain, x)
    assert allocations._running_logs == [] and not _profiler_enabled()


_INTERRUPTED_IMPORT = r"""
import copy, json, sys
import torch
from torch import nn

class InterruptedImport:
    '''Ctrl-C as sympy's first import reaches sympy.printing (sympy.logic already loaded).'''
    fired = False
    def find_spec(self, name, path=None, target=None):
        if name == "sympy.printing" and not self.fired:
            type(self).fired = True
            raise KeyboardInterrupt
        return None

sys.path.insert(0, sys.argv[1])
from tests.faults.test_interrupt_faults import _assert_trains_as_plain, _net
from lightning_remat import remat
assert "sympy" not in sys.modules
model, x = _net(), torch.randn(256, 64)
plain = copy.deepcopy(model)
sys.meta_path.insert(0, InterruptedImport())
try:
    remat(model, x, "80%")
except KeyboardInterrupt:
    pass
_assert_trains_as_plain(model, plain, x)
import sympy
print(json.dumps({"fired": InterruptedImport.fired, "logic": hasattr(sympy, "logic")}))
"""


def test_an_interrupt_inside_the_first_import_of_sympy_leaves_no_half_imported_module():
    """In a fresh interpreter (this one has sympy whole): interrupted half way through,
    sympy's half is removed, so the next plan (which traces and checkpoints with torch's
    symbolic shapes, built on sympy) imports it whole."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT, str(ROOT)], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"fired": True, "logic": True}
