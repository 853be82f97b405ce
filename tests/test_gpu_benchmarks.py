"""benchmarks/gpu/: the four GPU commands parse their arguments, list their parts in a dry
run, and without a GPU refuse with a FAIL line and a JSON record (so they do not rot while
no GPU is at hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import batch_search, plans, strategy, tests_and_peaks

COMMANDS = [tests_and_peaks, plans, strategy, batch_search]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.__name__.rsplit(".", 1)[-1])
def test_dry_run_lists_the_parts(command, capsys):
    assert command.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would run:" in out and "dry run, nothing measured" in out


def test_the_parts_fit_nine_minutes_and_name_existing_files():
    root = Path(__file__).resolve().parents[1]
    assert sum(seconds for _, _, seconds, _ in tests_and_peaks.parts()) < 9 * 60
    assert sum(seconds for _, _, seconds in plans.parts()) < 9 * 60
    for _, command, _, _ in tests_and_peaks.parts():
        assert all((root / arg).exists() for arg in command if arg.endswith(".py"))
    assert not (root / "benchmarks" / "gpu.sh").exists()  # replaced by these commands


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the refusal path is not taken")
def test_without_a_gpu_each_command_fails_with_a_json_record(tmp_path, capsys):
    for command in COMMANDS:
        out = tmp_path / f"{command.__name__}.json"
        assert command.main(["--out", str(out)]) == 1
        record = json.loads(out.read_text())
        assert record["passed"] is False and record["device"] == "none" and record["date"]
        assert record["checks"][0]["name"] == "cuda device"
    assert "FAIL cuda device: no CUDA device" in capsys.readouterr().out
