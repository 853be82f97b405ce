"""benchmarks/planning.py's JSON rendered into RESULTS.md's planning-cost table."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import render


def test_planning_section_renders_phases_and_search_in_plain_steps(tmp_path: Path) -> None:
    record = {
        "date": "2026-11-24 12:00 UTC", "machine": "x86_64, 2 CPUs", "device": "cpu", "torch": "2.13.0",
        "commit": "abc1234", "load_average": 3.0,
        "phases": [{"model": "gpt", "batch": 8, "size": 256, "plain_step": 0.5, "trace": 0.25,
                    "profile": 2.0, "profile_cpu": 1.0, "plain_step_cpu": 0.5, "solve": 0.1, "solver": "auto:feng", "remat": 2.5}],
        "search": [{"model": "gpt", "cap_bytes": 100 * 2**20, "base_batch": 8, "plain_step": 0.5,
                    "ours_seconds": 10.0, "ours_trials": 2, "ours_trial_steps": 2, "ours_found": 24,
                    "lightning_seconds": 20.0, "lightning_trials": 7, "lightning_trial_steps": 7,
                    "lightning_found": 16}],
    }
    (tmp_path / "cpu.json").write_text(json.dumps(record))
    text = "\n".join(render.planning_section(tmp_path))
    assert "## Planning cost (cpu)" in text and "abc1234" in text
    assert "| gpt | 8 | 0.500 s | 0.25 s (0.5) | 2.00 s (4.0; CPU 2.0) | 0.10 s (0.2) | 2.50 s (5.0) |" in text
    assert "| gpt | 100.0 | 2 | 2 | 24 | 10.0 s (20.0) | 7 | 7 | 16 | 20.0 s (40.0) |" in text
    assert render.planning_section(tmp_path / "missing") == []
