"""benchmarks/run.py and benchmarks/render.py: the comparison table a user reads in
RESULTS.md must come from real measurements, name its commit, and refuse a dirty tree."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    assert run.measure("unet", "checkpoint_sequential:2", "cpu", 2, 32, 1) == {"skipped": "no sequential form"}
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
            "plain": {"peak_bytes": 100 * mib, "step_seconds": 1.0, "grad_rel_diff": 0.0, "norm_diff": 0.0,
                      "edge_peak_bytes": 101 * mib},
            "compile:0.5": {"peak_bytes": 70 * mib, "step_seconds": 0.9, "grad_rel_diff": 2e-5,
                            "norm_diff": 0.0},
            "remat:auto:50%": {"peak_bytes": 49 * mib, "edge_peak_bytes": 51 * mib, "step_seconds": 1.3,
                               "grad_rel_diff": 0.0,
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
    # Beside the meter's peak, the allocator's edge: marked where over the plan's budget.
    assert "| remat auto @50% | 49.0 | 51.0 (over budget) | 0.49 | 1.30 | 0.0e+00 |" in text
    assert "| plain | 100.0 | 101.0 | 1.00 |" in text
    assert "| torch.compile, activation budget 0.5 | 70.0 | - |" in text
    assert "smallest budget 40.0 MiB (40% of plain)" in text
    assert "| remat auto | 20 | 2.50x |" in text  # largest batch against plain's
    assert "| feng | min 40% 0.01s | 45% +30% 0.01s |" in text
    assert (tmp_path / "plots" / "cpu-quick.png").stat().st_size > 1000
    assert "where the targets are missed" not in text
    (results / "analysis.md").write_text("Measured on 2026-11-24: the executor's own time.\n")
    text = render.render(tmp_path / "results", tmp_path / "plots", tmp_path / "RESULTS.md")
    assert "### cpu-quick: where the targets are missed, and why" in text
    assert "Measured on 2026-11-24: the executor's own time." in text
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
    # Per model: plain's peak, auto's peak and time against plain at each budget it reached
    # (25% reached nothing anywhere: no column), the largest batch of each within plain's peak.
    assert "| model | plain peak | `auto` @50%: peak, time | largest batch: plain, `auto` |" in text
    assert "| [gpt](benchmarks/RESULTS.md#cpu-quick-gpt) | 100.0 MiB | 0.49, 1.30x | 8, 20 |" in text
    assert "equal to plain training's after one step (difference 0) in 1 of the 1 measured `remat` rows" in text
    assert len(text.splitlines()) < 20  # a summary: every other row is in RESULTS.md
    (tmp_path / "plain.md").write_text("no markers\n")
    assert not render.update_readme(tmp_path / "plain.md", tmp_path / "results")


def test_readme_summary_names_the_smallest_budget_and_prefers_the_gpu_run(tmp_path: Path) -> None:
    """A budget no plan reaches shows the smallest one that does; with a GPU run beside the
    CPU runs, the summary is the GPU's alone (the figures a user's choice rests on)."""
    mib = 2**20
    gpt, unet = _record("gpt", "abc1234567"), _record("unet", "abc1234567")
    gpt["rows"]["remat:auto:50%"]["grad_rel_diff"] = 1e-7
    unet["rows"]["remat:auto:50%"] = {"skipped": "infeasible", "min_budget_bytes": 80 * mib}
    (tmp_path / "results" / "cpu").mkdir(parents=True)
    for record in (gpt, unet):
        (tmp_path / "results" / "cpu" / f"{record['model']}.json").write_text(json.dumps(record))
    text = render.summary(tmp_path / "results")
    assert "| [unet](benchmarks/RESULTS.md#cpu-unet) | 100.0 MiB | no plan; smallest 80.0 MiB | 8, 20 |" in text
    assert "in 0 of the 1 measured `remat` rows" in text
    cuda = {**_record("unet", "def7654321"), "machine": "NVIDIA H100", "device": "cuda"}
    (tmp_path / "results" / "cuda").mkdir()
    (tmp_path / "results" / "cuda" / "unet.json").write_text(json.dumps(cuda))
    text = render.summary(tmp_path / "results")
    assert "Measured on NVIDIA H100" in text and "RESULTS.md#cuda-unet" in text
    assert "abc1234567" not in text and "#cpu-gpt" not in text
    # A GPU run that shared its device with other work has no fair times: the CPU run leads,
    # and RESULTS.md says why the GPU's times are not to be read.
    cuda["shared_device"] = "another benchmark ran beside it"
    (tmp_path / "results" / "cuda" / "unet.json").write_text(json.dumps(cuda))
    assert "Measured on NVIDIA H100" not in render.summary(tmp_path / "results")
    rendered = render.render(tmp_path / "results", tmp_path / "plots", tmp_path / "R.md")
    assert "not a fair measure: another benchmark ran beside it" in rendered


def test_the_readme_shows_the_results_files_figures() -> None:
    """The README's results block is what render.py makes of benchmarks/results/ now: after
    new measurements, ``python benchmarks/render.py`` rewrites it."""
    text = render.README.read_text()
    assert render.README_BEGIN in text and render.README_END in text
    block = text.split(render.README_BEGIN, 1)[1].split(render.README_END, 1)[0]
    assert block.strip() == render.summary().strip()


def _equal_memory_record() -> dict:
    """A results record with the equal-memory comparison: checkpoint_sequential:2 peaks at
    60 MiB at 1.10x plain; auto at that budget measured 58 MiB at 1.21x (slower by 10%),
    kusumoto-tc chose the same plan (one measurement), kusumoto-mc 55 MiB at 1.32x, chen
    could not reach it."""
    mib = 2**20
    record = _record("resnet50", "abc1234567")
    rows = record["rows"]
    rows["checkpoint_sequential:2"] = {"peak_bytes": 60 * mib, "step_seconds": 2.2, "plain_step_seconds": 2.0,
                                       "grad_rel_diff": 0.0, "norm_diff": 1.0}
    planned = {"budget_bytes": 60 * mib, "profiled_step_seconds": 1.0, "recomputed": 3}
    auto = {**planned, "solver": "auto:kusumoto-tc", "plan_line": 0, "predicted_peak_bytes": 57 * mib,
            "predicted_extra_seconds": 0.15, "peak_bytes": 58 * mib, "step_seconds": 1.21,
            "plain_step_seconds": 1.0, "grad_rel_diff": 0.0, "norm_diff": 0.0}
    record["equal_memory"] = {"checkpoint_sequential:2": {
        "auto": auto,
        "kusumoto-tc": {**auto, "solver": "kusumoto-tc", "same_plan_as": "checkpoint_sequential:2|auto"},
        "kusumoto-mc": {**planned, "solver": "kusumoto-mc", "plan_line": 1, "predicted_peak_bytes": 56 * mib,
                        "predicted_extra_seconds": 0.3, "peak_bytes": 55 * mib, "step_seconds": 2.64,
                        "plain_step_seconds": 2.0, "grad_rel_diff": 0.0, "norm_diff": 0.0},
        "chen": {"skipped": "infeasible", "budget_bytes": 60 * mib, "min_budget_bytes": 66 * mib}}}
    return record


def test_render_gives_the_equal_memory_table_and_its_verdicts(tmp_path: Path) -> None:
    results = tmp_path / "results" / "cpu"
    results.mkdir(parents=True)
    (results / "resnet50.json").write_text(json.dumps(_equal_memory_record()))
    text = render.render(tmp_path / "results", tmp_path / "plots", tmp_path / "RESULTS.md")
    lines = text.splitlines()
    # The peer once, then each solver at its peak: time/plain 1.21 against the peer's 1.10.
    assert ("| checkpoint_sequential, 2 segments | 60.0 | 0.60 | 1.10 | auto (auto:kusumoto-tc) | 58.0 | "
            "0.58 | 1.21 | slower by 10% |") in lines
    assert ("| | | | | kusumoto-tc, checkpoint_sequential:2: auto's plan | 58.0 | 0.58 | 1.21 | "
            "slower by 10% |") in lines
    # At 1.32 against 1.10, and well under the peer's peak (55 MiB against 60: said).
    assert "| | | | | kusumoto-mc | 55.0 | 0.55 | 1.32 | slower by 20%, peak 8.3% below the peer's |" in lines
    assert "| | | | | chen | - | - | - | infeasible: smallest budget 66.0 MiB, +10% of the peer's peak |" in lines
    # The findings: auto slower than the peer in the one configuration; tc faster than mc.
    assert "`remat auto` at a peer's measured peak is at most the peer's time in 0 of 1 configurations." in text
    assert "- resnet50 at the peak of checkpoint_sequential, 2 segments: slower by 10%" in text
    assert "`kusumoto-tc` is nowhere slower than another solver" in text
    found = render.equal_memory_findings([_equal_memory_record()])
    slow_tc = _equal_memory_record()
    slow_tc["equal_memory"]["checkpoint_sequential:2"]["kusumoto-tc"]["step_seconds"] = 1.5
    assert found["tc_misses"] == []
    assert render.equal_memory_findings([slow_tc])["tc_misses"] == [
        "resnet50 at the peak of checkpoint_sequential, 2 segments: kusumoto-tc 14% slower than kusumoto-mc"]


def test_prediction_columns_cover_every_measured_plan_once(tmp_path: Path) -> None:
    record = _equal_memory_record()
    record["rows"]["remat:auto:50%"]["plain_step_seconds"] = 1.0
    record["largest_batch"]["remat:auto:cap"]["rows"] = {"20": {
        "solver": "auto:kusumoto-mc", "predicted_peak_bytes": 98 * 2**20, "predicted_extra_seconds": 0.25,
        "profiled_step_seconds": 1.0, "peak_bytes": 99 * 2**20, "step_seconds": 1.28, "plain_step_seconds": 1.0}}
    labels = [label for label, _ in render.measured_plans(record)]
    # The measured table's plan, the equal-memory cells measured (not the reused one), the probe.
    assert labels == ["remat auto @50%", "remat auto at the peak of checkpoint_sequential, 2 segments",
                      "remat kusumoto-mc at the peak of checkpoint_sequential, 2 segments",
                      "remat auto, batch 20, budget = cap"]
    table = render.prediction_table(record)
    # auto @50%: predicted 48 MiB against 49 measured (-2.0%); extra +20% predicted, +30% measured.
    assert ("| remat auto @50% | auto:kusumoto-mc | 49.0 | 51.0 (over budget) | 48.0 | -2.0% | +30% | +20% | "
            "-10 pts |") in table
    assert ("| remat kusumoto-mc at the peak of checkpoint_sequential, 2 segments | kusumoto-mc | 55.0 | - | 56.0 | "
            "+1.8% | +32% | +30% | -2 pts |") in table
    worst = render.worst_predictions([record])
    assert worst["plans"] == 4 and worst["worst_extra"][1] == "remat auto @50%"
    assert worst["worst_peak"][1] == "remat auto @50%" and worst["peak_within"] == 4
    # Extra time: -10 (auto @50%) and -6 points (auto at the peer's peak) miss the 5-point
    # target; -2 (kusumoto-mc) and -3 (the probe) meet it.
    assert worst["extra_within"] == 2
    assert render.prediction_errors({"peak_bytes": 1}) is None

    # prediction.py reports the same rows from the results files and exits 1 on a miss.
    results = tmp_path / "results" / "cpu"
    results.mkdir(parents=True)
    (results / "resnet50.json").write_text(json.dumps(record))
    proc = subprocess.run([sys.executable, str(run.ROOT / "benchmarks" / "prediction.py"), "--results",
                           str(tmp_path / "results")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "worst extra-time error: -10 points (resnet50, remat auto @50%: predicted +20%, measured +30%)" in proc.stdout
    assert "4 plans: peak within 3% for 4, extra time within 5 points for 2" in proc.stdout


def test_our_plans_are_made_once_and_each_distinct_plan_measured_once(tmp_path, monkeypatch) -> None:
    """measure_ours: one profile for every request, one measurement per distinct plan, and
    rows and equal-memory cells filled from them (no process is started: spawn is faked)."""
    calls: list[tuple[str, Any]] = []

    def fake_spawn(args, model, method, batch, size, cap_bytes=None, plans_file=None, requests=None):
        calls.append((method, requests))
        if method == "plan-all":
            return {"vertices": 9, "cells": {
                "remat:auto:75%": {"plan_line": 0, "solver": "auto:kusumoto-tc", "predicted_peak_bytes": 7},
                "remat:auto:25%": {"skipped": "infeasible", "min_budget_bytes": 5},
                "compile:0.5|auto": {"plan_line": 0, "solver": "auto:kusumoto-tc", "predicted_peak_bytes": 7},
                "compile:0.5|chen": {"plan_line": 1, "solver": "chen", "predicted_peak_bytes": 6}}}
        return {"peak_bytes": 100 + int(method.split(":")[1]), "step_seconds": 1.0, "plain_step_seconds": 1.0,
                "grad_rel_diff": 0.0, "norm_diff": 0.0}

    monkeypatch.setattr(run, "spawn", fake_spawn)
    monkeypatch.setattr(run, "RESULTS", tmp_path)
    args = argparse.Namespace(tag="cpu")
    record: dict = {"rows": {}}
    requests = [["remat:auto:75%", "auto", "75%"], ["remat:auto:25%", "auto", "25%"],
                ["compile:0.5|auto", "auto", 70], ["compile:0.5|chen", "chen", 70]]
    run.measure_ours(args, "gpt", 2, 32, record, requests, lambda: None, lambda line: None)
    assert [c[0] for c in calls] == ["plan-all", "plan:0", "plan:1"] and calls[0][1] == requests
    assert record["rows"]["remat:auto:75%"]["peak_bytes"] == 100
    assert record["rows"]["remat:auto:25%"] == {"skipped": "infeasible", "min_budget_bytes": 5}
    cells = record["equal_memory"]["compile:0.5"]
    assert cells["auto"]["peak_bytes"] == 100 and cells["auto"]["same_plan_as"] == "remat:auto:75%"
    assert cells["chen"]["peak_bytes"] == 101 and "same_plan_as" not in cells["chen"]
    assert record["profile"] == {"vertices": 9}


def test_the_gpt_sequential_form_is_the_same_model() -> None:
    import torch

    model, x, sequential = run.build("gpt", "cpu", batch=2, size=16)
    assert sequential is not None
    torch.manual_seed(0)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    sequential(x).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert {id(p) for p in sequential.parameters()} <= {id(p) for p in model.parameters()}


@pytest.mark.slow
def test_a_plan_made_on_one_profile_runs_in_another_process(tmp_path) -> None:
    """plan_all writes the profiled graph and each distinct plan; measuring one of them (as a
    fresh worker does) runs it through the executor with the plain model's gradients."""
    plans_file = tmp_path / "gpt.jsonl"
    requests = [["remat:chen:100%", "chen", "100%"], ["x|chen", "chen", 10**9], ["remat:dynprog:50%", "dynprog", "50%"]]
    out = run.plan_all("gpt", "cpu", 2, 32, requests, plans_file)
    cells = out["cells"]
    assert cells["remat:chen:100%"]["plan_line"] == cells["x|chen"]["plan_line"] == 0  # one distinct plan
    assert "GPU" in cells["remat:dynprog:50%"]["skipped"]
    assert len(plans_file.read_text().splitlines()) == 1 and run.graph_path(plans_file).exists()
    assert {c["solver"] for c in out["predictions"]["cells"]} == set(run.PREDICTED_SOLVERS)
    row = run.measure("gpt", "plan:0", "cpu", 2, 32, 1, plans_file=str(plans_file))
    assert row["grad_rel_diff"] == 0.0 and row["peak_bytes"] > 0


def test_the_equal_memory_set_keeps_every_model_and_peer_of_the_comparison() -> None:
    """--set equal-memory is the CPU set that fits the machine: it drops models and the
    largest-batch search, never a model of the comparison or a peer configuration."""
    args = argparse.Namespace(quick=False, set="equal-memory", no_compile=False)
    chosen = run.selection(args)
    assert set(chosen["models"]) == {"resnet50", "densenet121", "unet", "gpt"}
    assert chosen["equal_memory_models"] == chosen["models"] and not chosen["largest_batch"]
    assert chosen["equal_memory_solvers"] == ["auto", "kusumoto-tc", "kusumoto-mc", "feng", "hong-linear", "chen"]
    peers = [m for part, m in run.methods_for("resnet50", args, has_sequential=True) if part == "peers"]
    assert peers == ["plain", "checkpoint_sequential:2", "checkpoint_sequential:4", "checkpoint_sequential:8",
                     "compile:0.5", "compile:0.25"]
    assert run.SIZES["cpu"]["resnet50"] == (16, 160)  # activations dominate its peak
    with pytest.raises(SystemExit):
        run.main(["--quick", "--set", "equal-memory"])


def test_a_compile_peak_read_eagerly_on_the_cpu_is_not_compared(tmp_path: Path) -> None:
    """On the CPU the meter's dispatch mode keeps torch.compile from compiling the measured
    step: a compile peak equal to plain's to the byte is flagged, and no verdict rests on it."""
    record = _equal_memory_record()
    record["rows"]["compile:0.5"]["peak_bytes"] = record["rows"]["plain"]["peak_bytes"]
    record["equal_memory"]["compile:0.5"] = {"auto": dict(record["equal_memory"]["checkpoint_sequential:2"]["auto"])}
    found = render.equal_memory_findings([record])
    assert found["not_comparable"] == ["resnet50 at the peak of torch.compile, activation budget 0.5"]
    assert len(found["auto_misses"]) == 1  # checkpoint_sequential's verdict still stands
    table = "\n".join(render.equal_memory_table(record))
    assert "not comparable: the peer's peak is its eager step's" in table
    assert render.EAGER_READING in "\n".join(render.measured_table(record))
    record["device"] = "cuda"  # the allocator's counters see compiled code
    assert render.equal_memory_findings([record])["not_comparable"] == []


def test_every_accepted_plan_is_held_to_its_own_budget_at_the_edge() -> None:
    """A plan chosen at two budgets is measured once; at the allocator's edge it is held to
    each budget it was accepted for, the reused cell's included, and the one over is named."""
    mib = 2**20
    measured = {"plan_line": 0, "budget_bytes": 60 * mib, "predicted_peak_bytes": 50 * mib,
                "peak_bytes": 50 * mib, "edge_peak_bytes": 55 * mib}
    record = {"model": "m", "rows": {
        "plain": {"peak_bytes": 100 * mib, "edge_peak_bytes": 101 * mib},
        "remat:auto:60%": measured,
        "remat:kusumoto-tc:52%": {**measured, "budget_bytes": 52 * mib, "same_plan_as": "remat:auto:60%"},
        "remat:auto:25%": {"skipped": "infeasible", "budget_bytes": 25 * mib},
    }, "equal_memory": {"checkpoint_sequential:2": {"auto": {**measured, "budget_bytes": 56 * mib}}}}
    got = render.edge_against_budgets([record])
    assert got["checked"] == 3
    assert [(m, b) for m, _, _, b in got["over"]] == [("m", 52 * mib)]
    assert "2 of the 3" in render.edge_sentence([record])


@pytest.mark.slow
def test_the_batch_search_benchmark_measures_a_tiny_model(tmp_path: Path) -> None:
    """benchmarks/batch_search.py's worker, in its own process as the benchmark runs it, on a
    tiny BERT: the budget is plain training's measured peak at B, so plain training's search
    finds B; remat's answer is at least that, its steps are measured within the budget, and
    the row renders."""
    import argparse

    pytest.importorskip("transformers")
    from benchmarks import batch_search

    row = batch_search.spawn("bert", argparse.Namespace(batch=2, init_val=2, max_val=8, steps_per_trial=1,
                                                        steps=2, timeout=600))
    assert "error" not in row, row["error"]
    assert "search_error" not in row, row["search_error"]
    assert row["budget_bytes"] == max(row["plain_peaks"]) > 0
    plain, remat = row["searches"]["plain"], row["searches"]["remat"]
    assert plain["largest_feasible"] == 2 and plain["trials_run"] >= 1
    assert remat["largest_feasible"] >= 2 and remat["trials_run"] >= 1
    assert row["check"]["batch"] == remat["largest_feasible"]
    assert 0 < row["least"]["fraction"] < 1 and row["least"]["capture"].startswith("torch.export")
    record = {"rows": {"bert": row}}
    (line,) = [x for x in batch_search.table(record) if x.startswith("| bert |")]
    assert batch_search.verdict(row) in line
    trial = max(t["peak_bytes"] for t in remat["trials"] if t["feasible"] and t["batch"] == row["check"]["batch"])
    # The search's answer trains within the budget: the fit's steps hold no more than the
    # trial measured (both from no gradients, the fit's loss result held alike).
    assert max(row["check"]["peaks"]) <= trial <= row["budget_bytes"]
    assert row["check"]["within_budget"]


def test_the_batch_search_verdict_names_what_misses() -> None:
    from benchmarks import batch_search

    def row(remat: int, trials: int, fraction: float, within: bool = True) -> dict:
        return {"batch": 8, "least": {"fraction": fraction}, "check": {"peaks": [1], "within_budget": within},
                "searches": {"plain": {"largest_feasible": 8, "trials_run": 2},
                             "remat": {"largest_feasible": remat, "trials_run": trials}}}

    assert batch_search.verdict(row(17, 4, 0.5)) == "holds"
    assert batch_search.verdict(row(8, 3, 0.5)) == "misses: remat's answer 8 not above B"
    assert batch_search.verdict(row(17, 5, 0.5)) == "misses: 5 trials"
    assert batch_search.verdict(row(17, 4, 0.5, within=False)) == "misses: its steps go over the budget"
    assert batch_search.verdict(row(8, 4, 0.8)).startswith("n/a")
    assert batch_search.verdict({"search_error": "x"}) == "misses: the search crashed"


def test_peers_tables_mark_where_our_smallest_budget_is_above_the_peers_peak(tmp_path: Path) -> None:
    """benchmarks/peers_checkpointing.py's tables: a budget of ours above HF's peak, a refusal
    and a peak over its budget are marked, and an architecture without gradient
    checkpointing is named as such."""
    from benchmarks import peers_checkpointing as peers

    mib = 2**20
    common = {"machine": "x86_64 CPU, 2 cores", "torch": "2.x", "commit": "abc1234567"}
    models = dict(common, date="2026-12-06 10:00 UTC", rows={
        "llama": {"peer": {"plain_peak_bytes": 100 * mib, "peak_bytes": 30 * mib, "step_seconds": 1.3,
                           "plain_step_seconds": 1.0},
                  "remat": {"infeasible": True, "min_budget_bytes": 36 * mib},
                  "remat_50": {"capture": "torch.export (non-strict)", "vertices": 269, "budget_bytes": 50 * mib,
                               "peak_bytes": 51 * mib, "min_budget_bytes": 36 * mib}}})
    architectures = dict(common, date="2026-12-06 11:00 UTC", mode="architectures", rows={
        "t5": {"peer": {"plain_peak_bytes": 10 * mib, "peak_bytes": 3 * mib},
               "remat": {"capture": "torch.export (non-strict)", "vertices": 444, "budget_bytes": 3 * mib,
                         "peak_bytes": 3 * mib, "min_budget_bytes": 2 * mib}},
        "distilbert": {"peer": {"plain_peak_bytes": 10 * mib, "unsupported": True},
                       "remat": {"capture": "torch.fx", "vertices": 50, "budget_bytes": 10 * mib,
                                 "peak_bytes": 10 * mib, "min_budget_bytes": 4 * mib}}})
    (tmp_path / "a.json").write_text(json.dumps(architectures))
    (tmp_path / "b.json").write_text(json.dumps(models))
    text = "\n".join(peers.render_section(tmp_path))
    assert text.index("(b)") < text.index("(a)")  # by the date measured
    assert "36.00 (0.36) **above the peer's** | **refused** (smallest 36.00 (0.36))" in text
    assert "51.00 (0.51), **over by 1.00**" in text
    assert "| t5 | 10.00 | 3.00 (0.30) | 2.00 (0.20) | -1.00 | 3.00 (0.30), held |" in text
    assert "| distilbert | 10.00 | no gradient checkpointing | 4.00 (0.40) |" in text


def test_the_edge_takes_a_threshold_from_a_page_to_64_kib() -> None:
    from benchmarks import edge

    assert edge.child_env(mmap_threshold=4096)["MALLOC_MMAP_THRESHOLD_"] == "4096"
    assert edge.child_env()["MALLOC_MMAP_THRESHOLD_"] == "65536"
    with pytest.raises(ValueError, match="from 4096"):
        edge.child_env(mmap_threshold=1024)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the edge reads /proc/self/status")
def test_with_a_page_threshold_the_edge_counts_buffers_under_64_kib() -> None:
    """256 tensors of 16 KiB held at once: in a child whose every buffer of a page or more is
    a mapping, the edge reads at least their 4 MiB (each is 5 pages with its header, and up to
    32 pages per CPU go unseen); with 64 KiB, the heap serves them, in part from free chunks
    the step never grew (a megabyte of them read 0.93 to 1.0 MB there, 1.15 to 1.19 MB with a
    page, 2026-12-07)."""
    from benchmarks.edge import child_env

    code = ("import torch\n"
            "from benchmarks.edge import edge_peak_bytes\n"
            "def step():\n"
            "    held = [torch.ones(4096) for _ in range(256)]\n"
            "    return held\n"
            "step()\n"  # the first op's code pages and pools: resident before the reading
            "print(edge_peak_bytes(step))\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env=child_env(mmap_threshold=4096, PYTHONPATH=str(root)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reading = int(proc.stdout.split()[-1])
    buffers = 256 * 16384
    assert buffers <= reading <= buffers + 256 * 2 * 4096, reading
