"""benchmarks/run.py and benchmarks/render.py: the comparison table a user reads in
RESULTS.md must come from real measurements, name its commit, and refuse a dirty tree."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import render, run


@settings(max_examples=200, deadline=None)
@given(base=st.integers(1, 64), limit=st.integers(0, 600), start=st.integers(1, 600))
def test_largest_batch_matches_brute_force(base: int, limit: int, start: int) -> None:
    grid = sorted({max(1, round(base * f)) for f in run.BATCH_GRID})
    expected = max((b for b in grid if b <= limit), default=None)
    best, probed = run.largest_batch(lambda b: b <= limit, base, start=start)
    assert best == expected
    assert len(probed) == len(set(probed))  # no batch is measured twice


def test_largest_batch_costs_two_probes_from_a_good_guess() -> None:
    best, probed = run.largest_batch(lambda b: b <= 20, 8, start=20)
    assert best == 20 and probed == [20, 24]


def _git(root: Path, *argv: str) -> None:
    subprocess.run(["git", *argv], cwd=root, check=True, capture_output=True)


def test_dirty_tree_is_refused_unless_allowed(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x")
    (tmp_path / "code.py").write_text("a = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "code")
    clean = run.git_commit(False, tmp_path)
    assert len(clean) == 10 and "+" not in clean
    # The benchmarks' own outputs do not count as changes.
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("old\n")
    _git(tmp_path, "add", "benchmarks/RESULTS.md")
    _git(tmp_path, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "-m", "results")
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("new\n")
    assert "+" not in run.git_commit(False, tmp_path)
    (tmp_path / "code.py").write_text("a = 2\n")
    with pytest.raises(SystemExit, match="uncommitted changes.*--allow-dirty"):
        run.git_commit(False, tmp_path)
    assert run.git_commit(True, tmp_path).endswith("+dirty")


def test_measure_gives_plain_agreement_and_a_budgeted_plan() -> None:
    """A real worker measurement (in-process, a small GPT): our plan's gradients equal the
    plain model's, and the row carries what RESULTS.md shows."""
    plain = run.measure("gpt", "plain", "cpu", batch=2, size=32, repeats=1)
    assert plain["grad_rel_diff"] == 0.0 and plain["peak_bytes"] > 0 and plain["step_seconds"] > 0
    assert plain["plain_step_seconds"] > 0  # time/plain comes from steps alternated in one process
    ours = run.measure("gpt", "remat:kusumoto-mc:60%", "cpu", batch=2, size=32, repeats=1)
    if "skipped" not in ours:
        assert ours["grad_rel_diff"] == 0.0
        assert ours["solver"] == "kusumoto-mc"
        assert ours["predicted_peak_bytes"] <= ours["budget_bytes"]
    else:
        assert ours["min_budget_bytes"] > 0
    with_predictions = run.measure("gpt", run.PREDICTIONS_AT, "cpu", batch=2, size=32, repeats=1)
    cells = with_predictions["predictions"]["cells"]
    assert {(c["solver"], c["budget"]) for c in cells} == {
        (s, b) for s in run.PREDICTED_SOLVERS for b in run.BUDGETS}
    assert all(c["fits"] == ("predicted_peak_bytes" in c) for c in cells)
    assert run.measure("gpt", "checkpoint_sequential:2", "cpu", 2, 32, 1) == {"skipped": "no sequential form"}
    assert "GPU" in run.measure("gpt", "remat:dynprog:50%", "cpu", 2, 32, 1)["skipped"]
    with pytest.raises(ValueError, match="unknown method"):
        run.measure("gpt", "magic", "cpu", 2, 32, 1)


def test_batchnorm_statistics_are_compared() -> None:
    row = run.measure("unet", "remat:kusumoto-mc:60%", "cpu", batch=2, size=32, repeats=1)
    if "skipped" not in row:
        assert row["norm_diff"] == 0.0 and row["grad_rel_diff"] == 0.0


def _record(model: str, commit: str) -> dict:
    mib = 2**20
    return {
        "model": model, "batch": 8, "size": 128, "commit": commit, "machine": "x86_64 CPU, 2 cores",
        "torch": "2.13.0", "python": "3.11.7", "date": "2026-11-23", "device": "cpu", "quick": True,
        "rows": {
            "plain": {"peak_bytes": 100 * mib, "step_seconds": 1.0, "grad_rel_diff": 0.0, "norm_diff": 0.0},
            "compile:0.5": {"peak_bytes": 70 * mib, "step_seconds": 0.9, "grad_rel_diff": 2e-5,
                            "norm_diff": 0.0},
            "remat:auto:50%": {"peak_bytes": 49 * mib, "step_seconds": 1.3, "grad_rel_diff": 0.0,
                               "norm_diff": 0.0, "solver": "auto:kusumoto-mc", "recomputed": 4,
                               "budget_bytes": 50 * mib, "predicted_peak_bytes": 48 * mib,
                               "predicted_extra_seconds": 0.2, "profiled_step_seconds": 1.0},
            "remat:auto:25%": {"skipped": "infeasible", "min_budget_bytes": 40 * mib,
                               "plain_predicted_bytes": 100 * mib,
                               "predictions": {
                                   "plain_predicted_bytes": 100 * mib, "profiled_step_seconds": 1.0,
                                   "vertices": 30, "cells": [
                                       {"solver": "feng", "budget": "25%", "solver_seconds": 0.01,
                                        "fits": False, "min_budget_bytes": 40 * mib},
                                       {"solver": "feng", "budget": "50%", "solver_seconds": 0.01,
                                        "fits": True, "predicted_peak_bytes": 45 * mib,
                                        "predicted_extra_seconds": 0.3, "chosen": "feng"}]}},
        },
        "largest_batch": {"cap_bytes": 100 * mib,
                          "plain": {"batch": 8, "probes": {"8": 100 * mib, "10": 125 * mib}},
                          "remat:auto:cap": {"batch": 20, "probes": {"20": 99 * mib, "24": None}}},
    }


def test_render_names_every_row_and_its_commit(tmp_path: Path) -> None:
    results = tmp_path / "results" / "cpu-quick"
    results.mkdir(parents=True)
    (results / "gpt.json").write_text(json.dumps(_record("gpt", "abc1234567")))
    (results / "unet.json").write_text(json.dumps(_record("unet", "abc1234567")))
    text = render.render(tmp_path / "results", tmp_path / "plots", tmp_path / "RESULTS.md")
    assert "## cpu-quick" in text and "### cpu-quick gpt" in text and "### cpu-quick unet" in text
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line
                  and not line.startswith(("| method", "| solver"))]
    assert table_rows and all("abc1234567" in line for line in table_rows
                              if not line.startswith("| feng"))
    assert "| remat auto @50% | 49.0 | 0.49 | 1.30 | 0.0e+00 |" in text
    assert "smallest budget 40.0 MiB (40% of plain)" in text
    assert "| remat auto | 20 | 2.50x |" in text  # largest batch against plain's
    assert "| feng | min 40% 0.01s | 45% +30% 0.01s |" in text
    assert (tmp_path / "plots" / "cpu-quick.png").stat().st_size > 1000
    assert "](plots/cpu-quick.png)" in text


def test_readme_block_is_rewritten_from_the_results(tmp_path: Path) -> None:
    results = tmp_path / "results" / "cpu-quick"
    results.mkdir(parents=True)
    (results / "gpt.json").write_text(json.dumps(_record("gpt", "abc1234567")))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{render.README_BEGIN}\nstale\n{render.README_END}\ntail\n")
    assert render.update_readme(readme, tmp_path / "results")
    text = readme.read_text()
    assert "stale" not in text and text.endswith(f"{render.README_END}\ntail\n")
    assert "commit abc1234567" in text
    assert "| [gpt](benchmarks/RESULTS.md#cpu-quick-gpt) | remat auto @50% | 0.49 | 1.30 | 0e+00 | 0e+00 | 20 |" in text
    assert "| [gpt](benchmarks/RESULTS.md#cpu-quick-gpt) | plain | 1.00 | 1.00 | 0e+00 | 0e+00 | 8 |" in text
    (tmp_path / "plain.md").write_text("no markers\n")
    assert not render.update_readme(tmp_path / "plain.md", tmp_path / "results")


def test_gpu_script_parses_and_refuses_without_a_gpu() -> None:
    import sys

    import torch

    script = Path(run.ROOT) / "benchmarks" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the refusal path is not taken")
    proc = subprocess.run(["bash", str(script), "gpt", "peers"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 1 and "no CUDA device" in proc.stderr
