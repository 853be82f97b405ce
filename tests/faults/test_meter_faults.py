"""Importing the package, or planning with it, leaves the process as it found it: glibc's
allocator behaves as without the package, and no global setting stays changed."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_remat import remat
from lightning_remat.measure.peak import peak_bytes
from lightning_remat.measure.storage import StorageMeter

ROOT = Path(__file__).resolve().parents[2]

_FAULTS = r"""
import json, resource, sys
import torch
if sys.argv[1] == "package":
    import lightning_remat
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                          *[m for _ in range(5) for m in (nn.Linear(256, 256), nn.ReLU())],
                          nn.Linear(256, 8))
    lightning_remat.remat(model, torch.randn(2048, 64), memory_budget="80%")
def allocations():
    for _ in range(300):
        t = torch.ones(2 * 2**20 // 4)  # 2 MiB, written (its pages touched)
        del t
allocations()  # the allocator's steady state, as a training loop reaches it
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
allocations()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def minor_faults(mode: str) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    run = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])["faults"]


@pytest.mark.slow
def test_planning_leaves_the_allocator_as_without_the_package():
    """300 allocations of 2 MiB after remat(): the page faults of a process that never
    imported the package (a fixed 64 KiB mmap threshold made each one a fresh mapping:
    about 100 times as many)."""
    without = minor_faults("plain")
    with_package = minor_faults("package")
    assert with_package <= 3 * without + 300, (with_package, without)


def _global_settings() -> dict:
    root = logging.getLogger()
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "rng": torch.get_rng_state(),
        "warning_filters": list(warnings.filters),
        "root_level": root.level,
        "root_handlers": list(root.handlers),
        "grad_enabled": torch.is_grad_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "dispatch_modes": list(_get_current_dispatch_mode_stack()),
        # Planning puts the objects alive when it starts out of the collector's reach while
        # it measures, and hands them back.
        "gc_enabled": gc.isenabled(),
        "gc_frozen": gc.get_freeze_count(),
        "gc_threshold": gc.get_threshold(),
    }


def test_remat_leaves_no_global_setting_changed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 256), nn.BatchNorm1d(256), nn.ReLU(),
                          *[m for _ in range(4) for m in (nn.Linear(256, 256), nn.BatchNorm1d(256), nn.ReLU())],
                          nn.Linear(256, 4))
    x = torch.randn(1024, 16)
    before = _global_settings()
    remat_model = remat(model, x, memory_budget="80%")
    remat_model(x).sum().backward()
    after = _global_settings()
    rng_before, rng_after = before.pop("rng"), after.pop("rng")
    assert torch.equal(rng_before, rng_after)
    assert after == before


def test_storage_meter_counts_each_storage_once_and_subtracts_frees():
    with StorageMeter() as meter:
        a = torch.ones(1000)  # 4000 B
        view = a.view(10, 100)
        a.add_(1)  # in place: no new storage
        b = a.clone()  # 4000 B
        assert (meter.live, meter.peak) == (8000, 8000)
        del b
        assert meter.live == 4000
        del a, view
        assert meter.live == 0 and meter.peak == 8000
    assert not _get_current_dispatch_mode_stack()


def test_step_peak_sees_gradients_and_activations_without_the_allocator():
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 8))
    x = torch.randn(512, 256)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    activations = 2 * 512 * 1024 * 4  # the Linear's output and the ReLU's, held for backward

    def step() -> None:
        model(x).sum().backward()

    step()
    model.zero_grad(set_to_none=True)
    peak = peak_bytes(step)
    assert param_bytes + activations <= peak <= 1.5 * (param_bytes + activations), peak
