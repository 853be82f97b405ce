"""A batch-size search killed in a trial resumes: the trial it left RUNNING is marked failed
with one warning and its size runs again; the finished trials are kept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from lightning_remat.tuning.search import BisectionSampler, TrialResult, run_search
from lightning_remat.tuning.study import PARAM

ROOT = Path(__file__).resolve().parents[2]


def _trial(batch_size: int) -> TrialResult:
    return TrialResult(batch_size <= 12, peak_bytes=batch_size * 100, seconds=0.01)


def _resume(url: str) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run_search(_trial, storage=url, study_name="s")
    return result, [str(w.message) for w in record if "lightning-remat" in str(w.message)]


def test_a_trial_left_running_is_failed_and_its_size_runs_again(tmp_path):
    url = f"sqlite:///{tmp_path / 'batch_size.db'}"
    run_search(_trial, storage=url, study_name="s", max_trials=3)  # 2, 4, 8 fit
    with warnings.catch_warnings():  # the heartbeat is experimental; ask() is outside optimize
        warnings.simplefilter("ignore")
        storage = optuna.storages.RDBStorage(url, heartbeat_interval=1)
        study = optuna.load_study(study_name="s", storage=storage, sampler=BisectionSampler())
        stale = study.ask()
    assert stale.suggest_int(PARAM, 1, 8192) == 16  # what the killed search was measuring
    # Its last heartbeat, then the process died.
    storage.record_heartbeat(storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name("s"), stale.number))
    result, messages = _resume(url)
    assert messages == ["lightning-remat batch-size search (remat): 1 trial(s) of study 's' were "
                        "left running by an interrupted search (batch sizes [16]); marked them "
                        "failed, their sizes run again"], messages
    assert result.largest_feasible == 12 and result.smallest_infeasible == 13
    trials = optuna.load_study(study_name="s", storage=url).get_trials(deepcopy=False)
    assert trials[stale.number].state == TrialState.FAIL
    assert [t.params[PARAM] for t in trials[:3]] == [2, 4, 8]  # the finished trials are kept
    assert sum(t.params[PARAM] == 16 and t.state == TrialState.COMPLETE for t in trials) == 1
    assert not any(t.state == TrialState.RUNNING for t in trials)
    _, messages = _resume(url)  # nothing stale the second time
    assert messages == []


@pytest.mark.slow
def test_a_search_killed_in_a_trial_resumes(tmp_path):
    url = f"sqlite:///{tmp_path / 'batch_size.db'}"
    marker = tmp_path / "in_trial"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from lightning_remat.tuning.search import TrialResult, run_search

        def trial(batch_size):
            if batch_size == 16:
                Path({str(marker)!r}).write_text("measuring")
                time.sleep(600)
            return TrialResult(batch_size <= 12, peak_bytes=batch_size * 100, seconds=0.01)

        run_search(trial, storage={url!r}, study_name="s")
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the search never reached 16"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    result, messages = _resume(url)
    assert len(messages) == 1 and "batch sizes [16]" in messages[0], messages
    assert result.largest_feasible == 12
    sizes = [r.batch_size for r in result.trials]
    assert sizes[:3] == [2, 4, 8] and 16 in sizes  # kept, and the killed size measured again
