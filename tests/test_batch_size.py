"""The batch-size search: exactness, trial count against BatchSizeFinder, resume, OOM, the callback."""

from __future__ import annotations

import collections
import math
from types import SimpleNamespace

import optuna
import pytest
import pytorch_lightning as pl
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytorch_lightning.callbacks import BatchSizeFinder
from pytorch_lightning.tuner import batch_size_scaling
from torch import nn

from lightning_remat import RematBatchSizeFinder
from lightning_remat.errors import RematInfeasibleError
from lightning_remat.lightning.batch_size import find_max_batch_size
from lightning_remat.lightning.trial import LightningTrial, SearchSettings, resize_batch
from lightning_remat.planner import PlanSettings
from lightning_remat.tuning.search import (
    BisectionSampler,
    TrialResult,
    bracket,
    finished_records,
    next_batch_size,
    run_search,
)
from tests.lit_models import ConvNet, loaders


def threshold_trial(threshold: int, calls: list[int] | None = None):
    """Feasible exactly up to ``threshold`` (a brute-force oracle's ground truth)."""

    def trial(batch_size: int) -> TrialResult:
        if calls is not None:
            calls.append(batch_size)
        return TrialResult(batch_size <= threshold, peak_bytes=batch_size * 1000, seconds=1e-3 * batch_size + 1e-3)

    return trial


def brute_force(feasible, max_val: int) -> int | None:
    sizes = [b for b in range(1, max_val + 1) if feasible(b)]
    return max(sizes) if sizes else None


# ---- exactness --------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(threshold=st.integers(0, 600), init_val=st.integers(1, 40), span=st.integers(0, 500),
       granularity=st.sampled_from([1, 1, 1, 2, 5]))
def test_search_finds_the_brute_force_maximum(threshold, init_val, span, granularity):
    max_val = init_val + span
    calls: list[int] = []
    result = run_search(threshold_trial(threshold, calls), init_val=init_val, max_val=max_val,
                        granularity=granularity, max_trials=100)
    truth = brute_force(lambda b: b <= threshold, max_val)
    assert len(calls) == len(set(calls)), f"a size was tried twice: {calls}"
    assert result.finished
    lo, hi = result.largest_feasible or 0, result.smallest_infeasible
    assert lo <= (truth or 0)
    if hi is None:  # nothing failed: the largest size allowed fits
        assert lo == max_val == truth
    else:  # within the granularity asked for: truth lies in [largest feasible, smallest infeasible)
        assert (truth or 0) < hi <= lo + granularity
    if granularity == 1:
        assert result.largest_feasible == truth
        assert hi == (None if truth == max_val else (truth or 0) + 1)
    # every verdict the report shows is the oracle's
    assert all(r.feasible == (r.batch_size <= threshold) for r in result.trials)


def test_bracket_trusts_the_smallest_infeasible_size_when_measurements_disagree():
    br = bracket([(8, True), (16, False), (12, True), (24, True)])
    assert (br.largest_feasible, br.smallest_infeasible, br.monotone) == (12, 16, False)
    assert next_batch_size([(8, True), (16, False), (12, True), (24, True)], 2, 100) == 14


# ---- trial count against Lightning's BatchSizeFinder(mode="binsearch") --------------------------
class _Holder:
    """The least a model must offer Lightning's lightning_getattr/setattr."""

    _trainer = None

    def __init__(self, batch_size: int) -> None:
        self.batch_size = batch_size


def lightning_binsearch_trials(threshold: int, init_val: int, max_val: int, monkeypatch) -> tuple[int, int]:
    """Run Lightning's own ``_run_binsearch_scaling`` with its training loop replaced by the
    oracle (an OOM RuntimeError above ``threshold``); return (answer, loop runs). Only the
    loop run, the progress reset and the dataloader reset are replaced; the search logic,
    ``_adjust_batch_size`` and its ``max_val`` cap are Lightning's."""
    model = _Holder(init_val)
    loop = SimpleNamespace(setup_data=lambda: None,
                           _combined_loader=SimpleNamespace(_dataset_length=lambda: 10**9))
    trainer = SimpleNamespace(lightning_module=model, _active_loop=loop)
    runs: list[int] = []

    def fake_loop_run(trainer, params):
        runs.append(model.batch_size)
        if model.batch_size > threshold:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(batch_size_scaling, "_try_loop_run", fake_loop_run)
    monkeypatch.setattr(batch_size_scaling, "_reset_progress", lambda trainer: None)
    monkeypatch.setattr(batch_size_scaling, "_reset_dataloaders", lambda trainer: None)
    monkeypatch.setattr(batch_size_scaling, "garbage_collection_cuda", lambda: None)  # gc: slow, no effect
    answer = batch_size_scaling._run_binsearch_scaling(
        trainer, init_val, "batch_size", max_trials=25, params={}, margin=0.0, max_val=max_val)
    return answer, len(runs)


@settings(max_examples=80, deadline=None)
@given(threshold=st.integers(1, 3000), init_val=st.integers(1, 64))
def test_no_more_trials_than_lightning_binsearch_and_exact(threshold, init_val):
    # Lightning stops doubling *before* trying max_val, so it can only be compared where the
    # maximum lies below max_val; and it returns a size below init_val without testing it,
    # so the comparison starts from a feasible init_val (threshold >= init_val).
    if threshold < init_val:
        threshold = init_val
    max_val = 8192
    with pytest.MonkeyPatch.context() as mp:
        lightning_answer, lightning_trials = lightning_binsearch_trials(threshold, init_val, max_val, mp)
    result = run_search(threshold_trial(threshold), init_val=init_val, max_val=max_val, max_trials=100)
    assert result.largest_feasible == threshold  # exact
    assert len(result.trials) <= lightning_trials
    assert lightning_answer == threshold  # the oracle is the same for both


# ---- resume --------------------------------------------------------------------------------------
class Interrupted(Exception):
    pass


@pytest.mark.parametrize("kill_after", [1, 4, 7])
def test_resumes_an_interrupted_sqlite_study_without_repeating_a_trial(tmp_path, kill_after):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    threshold = 45
    first: list[int] = []
    oracle = threshold_trial(threshold, first)

    def dies(batch_size: int) -> TrialResult:
        if len(first) == kill_after:
            raise Interrupted("killed")
        return oracle(batch_size)

    with pytest.raises(Interrupted):
        run_search(dies, init_val=2, max_val=1000, storage=storage, study_name="s")
    second: list[int] = []
    result = run_search(threshold_trial(threshold, second), init_val=2, max_val=1000,
                        storage=storage, study_name="s")
    assert len(first) == kill_after
    assert not set(first) & set(second), (first, second)
    assert result.largest_feasible == threshold and result.smallest_infeasible == threshold + 1
    assert result.trials_run == len(second)
    uninterrupted = run_search(threshold_trial(threshold), init_val=2, max_val=1000)
    assert len(result.trials) == len(uninterrupted.trials)  # the resumed study wasted no trial
    states = [t.state for t in optuna.load_study(study_name="s", storage=storage).trials]
    assert states.count(optuna.trial.TrialState.FAIL) == 1  # the interrupted trial, re-run later


# ---- OOM and infeasible trials ---------------------------------------------------------------------
@pytest.mark.parametrize("error", [
    lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    lambda: RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    lambda: RematInfeasibleError(1000, 4000, "kusumoto-tc"),
])
def test_oom_or_infeasible_trial_does_not_kill_the_search(error, monkeypatch):
    freed: list[int] = []
    monkeypatch.setattr("lightning_remat.tuning.search.free_device_memory", lambda: freed.append(1))

    def trial(batch_size: int) -> TrialResult:
        if batch_size > 21:
            raise error()
        return TrialResult(True, peak_bytes=batch_size, seconds=0.01)

    result = run_search(trial, init_val=4, max_val=256)
    assert result.largest_feasible == 21 and result.smallest_infeasible == 22
    failed = [r for r in result.trials if not r.feasible]
    assert failed and all(r.reason for r in failed)
    if not isinstance(error(), RematInfeasibleError):
        assert len(freed) == len(failed)  # device memory released after every OOM


def test_the_pareto_front_holds_the_feasible_trials_no_other_one_beats():
    """Samples per second peak at batch 20 (the step slows down beyond it) and nothing above
    45 fits: the front is the feasible trials from the fastest up to the largest."""
    def trial(batch_size: int) -> TrialResult:
        seconds = 1e-2 + 1e-3 * batch_size + (1e-4 * (batch_size - 20) ** 2 if batch_size > 20 else 0.0)
        return TrialResult(batch_size <= 45, peak_bytes=batch_size, seconds=seconds)

    result = run_search(trial, init_val=2, max_val=1000)
    feasible = [r for r in result.trials if r.feasible]
    front = [r for r in feasible if not any(
        o.batch_size >= r.batch_size and o.samples_per_second >= r.samples_per_second
        and (o.batch_size, o.samples_per_second) != (r.batch_size, r.samples_per_second) for o in feasible)]
    assert len(front) >= 2 and result.pareto == sorted(front, key=lambda r: r.batch_size)
    assert result.pareto[-1].batch_size == 45 and all(r.feasible for r in result.pareto)


def test_an_unrelated_error_is_not_taken_for_an_infeasible_size():
    def trial(batch_size: int) -> TrialResult:
        raise ValueError("bug in the model")

    with pytest.raises(ValueError, match="bug in the model"):
        run_search(trial)


def test_sampler_proposal_is_read_from_the_study():
    study = optuna.create_study(directions=["maximize", "maximize"],
                                sampler=BisectionSampler(init_val=3, max_val=100))

    def objective(trial):
        b = trial.suggest_int("batch_size", 1, 100)
        trial.set_user_attr("feasible", b <= 10)
        return b, 0.0

    study.optimize(objective, n_trials=4)
    assert [r.batch_size for r in finished_records(study)] == [3, 6, 12, 9]


# ---- Lightning ----------------------------------------------------------------------------------
class SizedConvNet(ConvNet):
    """The shared ConvNet with a ``batch_size`` hyperparameter and its own dataloader."""

    def __init__(self, batch_size: int = 4, channels: int = 8, image: int = 8, oom_above: int | None = None,
                 samples: int = 48) -> None:
        super().__init__(channels=channels)
        self.samples = samples
        self.batch_size = batch_size
        self.image = image
        self.oom_above = oom_above

    def training_step(self, batch, batch_idx):
        if self.oom_above is not None and batch[0].shape[0] > self.oom_above:
            # half a step ran (weights touched) when the "device" runs out
            with torch.no_grad():
                self.head.weight.add_(1.0)
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return loaders(n=self.samples, batch_size=self.batch_size, size=self.image)[0]

    def val_dataloader(self):
        return loaders(n=8, batch_size=8, size=self.image)[1]


def small_trainer(tmp_path, **kwargs):
    return pl.Trainer(default_root_dir=str(tmp_path), accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                      **kwargs)


def _search_settings(trainer, budget_bytes):
    return SearchSettings(plan=PlanSettings(budget_bytes), budget_bytes=budget_bytes,
                          device=trainer.strategy.root_device, target=None,
                          cache_dir=tmp_cache(trainer))


def tmp_cache(trainer):
    from pathlib import Path

    return Path(trainer.default_root_dir) / "lightning_remat_cache"


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_callback_writes_the_largest_feasible_size_and_fit_uses_it(tmp_path):
    torch.manual_seed(0)
    model = SizedConvNet(batch_size=2)
    before = _state(model)
    seen = {}

    class Spy(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["untouched"] = all(torch.equal(v, before[k]) for k, v in pl_module.state_dict().items())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("batch", batch[0].shape[0])

    finder = RematBatchSizeFinder(memory_budget="2MiB", solver="plain", init_val=2, max_val=48,
                                  steps_per_trial=1, progress_bar=False)
    trainer = small_trainer(tmp_path, max_steps=1, callbacks=[finder, Spy()])
    trainer.fit(model)
    report = finder.report
    best = report.remat.largest_feasible
    assert best is not None and model.batch_size == best == finder.optimal_batch_size
    assert seen["batch"] == best  # the fit loop's dataloader was built with the new size
    assert seen["untouched"]  # the search trained nothing
    # each verdict is the measured peak against the budget
    for r in report.remat.trials:
        assert r.feasible == (r.peak_bytes <= 2 * 2**20)
    assert report.remat.smallest_infeasible is None or report.remat.smallest_infeasible == best + 1
    assert (tmp_path / "lightning_remat_cache" / "batch_size.db").exists()
    assert "largest fits" in report.table()


def test_trial_restores_weights_optimizer_state_and_batchnorm_after_an_oom(tmp_path):
    model = SizedConvNet(batch_size=2, image=16, oom_above=40)
    captured = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            opt = trainer.optimizers[0]
            for p in pl_module.parameters():  # give the optimizer some state to keep
                opt.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
            captured["before"] = _state(pl_module)
            trial = LightningTrial(trainer, pl_module, batch_arg_name="batch_size", steps_per_trial=2,
                                   solver="plain", settings=_search_settings(trainer, 2**30))
            captured["fits"] = trial(32)
            captured["after_fit"] = _state(pl_module)
            with pytest.raises(torch.cuda.OutOfMemoryError):
                trial(48)
            captured["after_oom"] = _state(pl_module)
            captured["momentum"] = [opt.state[p]["momentum_buffer"] for p in pl_module.parameters()]
            raise pl.utilities.exceptions._TunerExitException()

    trainer = small_trainer(tmp_path, max_steps=1, callbacks=[Probe()])
    trainer.fit(model)
    assert captured["fits"].feasible and captured["fits"].peak_bytes > 0 and captured["fits"].seconds > 0
    for key in ("after_fit", "after_oom"):
        for name, value in captured[key].items():
            assert torch.equal(value, captured["before"][name]), (key, name)
    assert all(torch.equal(m, torch.full_like(m, 0.5)) for m in captured["momentum"])


def test_find_max_batch_size_survives_oom_and_matches_the_oom_threshold(tmp_path):
    model = SizedConvNet(batch_size=2, oom_above=13)
    before = _state(model)
    report = find_max_batch_size(small_trainer(tmp_path, max_epochs=1), model, memory_budget="1GiB",
                                 solver="plain", init_val=2, max_val=64, steps_per_trial=1, progress_bar=False)
    assert report.batch_size == 13 == model.batch_size
    assert report.remat.smallest_infeasible == 14
    assert any("out of memory" in r.reason for r in report.remat.trials)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_plain_maximum_matches_lightning_binsearch_on_a_cpu_budget(tmp_path):
    """Same model, same budget: Lightning's BatchSizeFinder(mode="binsearch", margin=0) in a
    real Trainer, its training loop replaced by our measured plain trial (an OOM raised when
    the measured peak exceeds the budget; verdicts memoised so both see one oracle), against
    our search. Counted: BatchSizeFinder's loop runs, our completed trials."""
    budget = 2 * 2**20
    init_val, max_val = 2, 512

    def model():  # 16 px images: a few hundred KiB per sample, so the budget binds near 10
        return SizedConvNet(batch_size=init_val, image=16, samples=1024)

    report = find_max_batch_size(small_trainer(tmp_path / "ours", max_epochs=1), model(),
                                 memory_budget=budget, solver="plain", init_val=init_val, max_val=max_val,
                                 steps_per_trial=1, progress_bar=False)
    verdict = {r.batch_size: r.feasible for r in report.remat.trials}
    lightning_runs: list[int] = []

    def measured_loop_run(trainer, params):
        size = trainer.lightning_module.batch_size
        lightning_runs.append(size)
        if size not in verdict:
            trial = LightningTrial(trainer, trainer.lightning_module, batch_arg_name="batch_size",
                                   steps_per_trial=1, solver="plain", settings=_search_settings(trainer, budget))
            verdict[size] = trial(size).feasible
            trainer.lightning_module.batch_size = size
        if not verdict[size]:
            raise RuntimeError("CUDA out of memory. (measured peak over the CPU budget)")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(batch_size_scaling, "_try_loop_run", measured_loop_run)
        lightning_model = model()
        finder = BatchSizeFinder(mode="binsearch", init_val=init_val, max_val=max_val, margin=0.0, steps_per_trial=1)
        finder._early_exit = True
        small_trainer(tmp_path / "lightning", max_epochs=1, callbacks=[finder]).fit(lightning_model)
    ours = report.remat
    assert ours.largest_feasible is not None and ours.largest_feasible < max_val  # the budget binds
    assert finder.optimal_batch_size == ours.largest_feasible
    assert ours.smallest_infeasible == ours.largest_feasible + 1
    assert len(ours.trials) <= len(lightning_runs), ([r.batch_size for r in ours.trials], lightning_runs)


class HookedConvNet(SizedConvNet):
    """Counts the LightningModule hooks Lightning's loop calls around a training step."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: collections.Counter = collections.Counter()

    def backward(self, loss, *args, **kwargs):
        self.calls["backward"] += 1  # called by the precision plugin, from the strategy
        super().backward(loss, *args, **kwargs)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.calls["clip"] += 1
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, *args, **kwargs):
        self.calls["optimizer_step"] += 1
        super().optimizer_step(*args, **kwargs)

    def optimizer_zero_grad(self, *args, **kwargs):
        self.calls["zero_grad"] += 1
        super().optimizer_zero_grad(*args, **kwargs)


def test_trial_steps_run_lightnings_backward_clipping_and_optimizer_step(tmp_path):
    """A trial's steps are the steps training takes: the strategy's backward (precision
    plugin, the module's backward hook), the module's optimizer_step, gradient clipping and
    optimizer_zero_grad, once per measured step; callbacks do not see them."""
    seen = collections.Counter()

    class Watcher(pl.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen["before_backward"] += 1

        def on_train_start(self, trainer, pl_module):
            seen["search"] = dict(pl_module.calls)

    model = HookedConvNet(batch_size=2)
    finder = RematBatchSizeFinder(memory_budget="2MiB", solver="plain", init_val=2, max_val=48,
                                  steps_per_trial=2, compare_plain=False, progress_bar=False)
    small_trainer(tmp_path, max_steps=1, gradient_clip_val=0.5, callbacks=[finder, Watcher()]).fit(model)
    steps = 2 * len(finder.report.remat.trials)
    assert steps >= 4
    assert seen["search"] == {"backward": steps, "clip": steps, "optimizer_step": steps, "zero_grad": steps}
    assert seen["before_backward"] == 1  # the one step fit took after the search
    assert "forward" not in model.__dict__  # the module is as it was


def test_the_private_lightning_names_the_search_uses_exist(tmp_path):
    """The search (batch_size.py, trial.py) reads ``fit_loop._data_source`` and resets ``fit_loop._combined_loader``
    (as Lightning's BatchSizeFinder does), and ends fit with ``_TunerExitException``;
    pyproject.toml bounds pytorch-lightning to the versions where they exist. A dataloader
    built before the search (configure_optimizers reading estimated_stepping_batches) is
    built again at the size found."""
    from pytorch_lightning.utilities.exceptions import _TunerExitException  # noqa: F401

    seen = {}

    class Stepping(SizedConvNet):
        def configure_optimizers(self):
            seen["stepping_batches"] = self.trainer.estimated_stepping_batches  # loads the dataloader
            return super().configure_optimizers()

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            source = trainer.fit_loop._data_source
            seen["from_module"] = source.is_module()
            seen["first_batch"] = next(iter(source.dataloader()))[0].shape[0]
            seen["loader_built"] = trainer.fit_loop._combined_loader is not None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("trained_on", batch[0].shape[0])

    finder = RematBatchSizeFinder(memory_budget="2MiB", solver="plain", init_val=2, max_val=48,
                                  steps_per_trial=1, compare_plain=False, progress_bar=False)
    model = Stepping(batch_size=3)
    small_trainer(tmp_path, max_epochs=1, limit_train_batches=1, callbacks=[Probe(), finder]).fit(model)
    assert seen["from_module"] and seen["first_batch"] == 3 and seen["loader_built"]
    assert seen["trained_on"] == finder.optimal_batch_size == model.batch_size != 3


def _pipeline_missing() -> str | None:
    """Why the trace/profile/solve/apply pipeline cannot run here (None: it can)."""
    try:
        import lightning_remat.runtime.module  # noqa: F401
        from lightning_remat.graph.profile import profile_module  # noqa: F401
        from lightning_remat.graph.trace import trace_module  # noqa: F401
        from lightning_remat.solvers import get_solver

        get_solver("kusumoto-tc")
    except (ImportError, NotImplementedError) as exc:
        return f"rematerialization pipeline not on this branch yet: {exc}"
    return None


@pytest.mark.skipif(_pipeline_missing() is not None, reason=str(_pipeline_missing()))
def test_remat_search_uses_the_strategy_budget_and_fits_at_least_plain(tmp_path):
    from lightning_remat import RematStrategy

    # Activations of a few hundred KiB, well above the meter's 64 KiB resolution, so the
    # simulator's prediction is as close to the measurement as on real models.
    budget = 16 * 2**20
    model = SizedConvNet(batch_size=2, channels=16, image=32, samples=256)
    before = _state(model)
    trainer = small_trainer(tmp_path, max_epochs=1,
                            strategy=RematStrategy(memory_budget=budget, solver="auto", profile_steps=1,
                                                   offload=False))
    report = find_max_batch_size(trainer, model, init_val=2, max_val=256, steps_per_trial=1, progress_bar=False)
    assert report.budget_bytes == budget and report.remat.solver == "auto"
    plain, remat = report.plain, report.remat
    assert plain is not None and plain.largest_feasible and remat.largest_feasible
    assert remat.largest_feasible >= plain.largest_feasible
    # Plain training's answer is remat's floor: not measured again by remat's search.
    assert remat.floor == plain.largest_feasible and all(r.batch_size > remat.floor for r in remat.trials)
    for r in remat.trials:  # feasible means planned and measured within the budget
        assert r.feasible == (r.peak_bytes is not None and r.peak_bytes <= budget)
        if r.peak_bytes is not None:
            assert r.predicted_extra_seconds is not None
    assert model.batch_size == remat.largest_feasible
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def tiny_net() -> torch.nn.Module:
    """A factory for the CLI test (``tests.test_batch_size:tiny_net``)."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.Flatten())


def test_cli_tune_prints_the_report(tmp_path, capsys):
    from lightning_remat.cli import main

    code = main(["tune", "tests.test_batch_size:tiny_net", "--input-shape", "3,16,16", "--budget", "1MiB",
                 "--solver", "plain", "--init-val", "2", "--max-val", "256", "--steps-per-trial", "1",
                 "--root-dir", str(tmp_path), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "largest fits" in out and "plain" in out
    assert (tmp_path / "lightning_remat_cache" / "batch_size.db").exists()
    assert main(["tune", "tests.test_batch_size:tiny_net", "--root-dir", str(tmp_path)]) == 2  # no budget on CPU
    assert "--budget" in capsys.readouterr().err


# ---- inputs --------------------------------------------------------------------------------------
def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="fraction of the plain step.s peak, which grows with the batch size"):
        RematBatchSizeFinder(memory_budget="60%")
    with pytest.raises(ValueError, match="init_val"):
        RematBatchSizeFinder(init_val=64, max_val=8)
    with pytest.raises(ValueError, match="solver"):
        RematBatchSizeFinder(solver="nope")
    with pytest.raises(ValueError, match="steps_per_trial"):
        RematBatchSizeFinder(steps_per_trial=0)
    for timeout in (0, -1.0, "60", True):
        with pytest.raises(ValueError, match="collective_timeout"):
            RematBatchSizeFinder(collective_timeout=timeout)


def test_cpu_search_without_a_budget_is_refused(tmp_path):
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="memory_budget"):
        find_max_batch_size(small_trainer(tmp_path, max_epochs=1), SizedConvNet(), solver="plain",
                            progress_bar=False)


def test_resize_batch_cuts_and_tiles_every_tensor():
    x, y = torch.arange(12.0).reshape(3, 4), torch.arange(3)
    xs, ys = resize_batch((x, y), 7)
    assert xs.shape == (7, 4) and ys.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert resize_batch({"x": x}, 2)["x"].shape == (2, 4)


def test_trial_bound_is_logarithmic():
    calls: list[int] = []
    run_search(threshold_trial(5000, calls), init_val=1, max_val=8192)
    assert len(calls) <= 2 * math.ceil(math.log2(8192)) + 1


def test_the_search_leaves_optunas_log_level_as_it_found_it():
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.DEBUG)
    try:
        run_search(threshold_trial(5), init_val=2, max_val=16)
        assert optuna.logging.get_verbosity() == optuna.logging.DEBUG
    finally:
        optuna.logging.set_verbosity(before)


class SubmoduleStepNet(SizedConvNet):
    """A training_step that runs ``self.net(x)``, a submodule, and never the module's own
    forward (which fx could not trace, and which no step calls)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(self.stem, *self.tail, nn.AdaptiveAvgPool2d(1), nn.Flatten(), self.head)

    def forward(self, x, *args, **kwargs):
        raise AssertionError("training_step does not call the LightningModule itself")

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)


def test_a_trial_plans_the_module_training_step_runs(tmp_path):
    """Under a strategy that plans what training_step runs, a batch-size trial plans the
    same module: ``self.net`` where the step calls it, not the LightningModule's forward."""
    from lightning_remat import RematStrategy

    model = SubmoduleStepNet(batch_size=2, channels=8, image=16)
    captured = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            trial = LightningTrial(trainer, pl_module, batch_arg_name="batch_size", steps_per_trial=1,
                                   solver="auto", settings=_search_settings(trainer, 2**30))
            captured["result"], captured["target"] = trial(8), trial.target
            raise pl.utilities.exceptions._TunerExitException()

    strategy = RematStrategy(memory_budget="60%", solver="auto", offload=False, cache_dir=tmp_path / "c")
    small_trainer(tmp_path, max_steps=1, callbacks=[Probe()], strategy=strategy).fit(model)
    assert captured["target"] is model.net
    assert captured["result"].feasible and captured["result"].solver.startswith("auto")


class ExportedConvNet(SizedConvNet):
    """A forward fx cannot trace (``**kwargs``), so ``torch.export`` captures it, with a
    reshape whose sizes the capture bakes in (its batch among them)."""

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.stem(x)
        h = self.act(h + self.block(h))
        h = self.tail(h)
        return self.head(h.reshape(h.shape[0], h.shape[1], -1).mean(2))


def test_an_exported_capture_is_made_again_at_each_trials_batch_size(tmp_path):
    """A trial at another batch size than the family's runs a capture made at its own size:
    an exported graph replayed at another batch multiplied mismatched shapes and ended the
    search. The search completes, and remat's answer is at least plain's."""
    from lightning_remat import RematStrategy

    budget = 16 * 2**20
    model = ExportedConvNet(batch_size=2, channels=16, image=32, samples=256)
    trainer = small_trainer(tmp_path, max_epochs=1,
                            strategy=RematStrategy(memory_budget=budget, solver="auto", profile_steps=1,
                                                   offload=False))
    report = find_max_batch_size(trainer, model, init_val=2, max_val=256, steps_per_trial=1, progress_bar=False)
    plain, remat = report.plain, report.remat
    assert plain is not None and plain.largest_feasible and remat.largest_feasible
    assert remat.largest_feasible >= plain.largest_feasible
    assert len({r.batch_size for r in remat.trials}) >= 2


def test_the_study_is_named_after_what_the_answer_depends_on():
    """A resumed search finds its study when the model is the same (a new instance with the
    same layers), and not when the model changed: a layer's width, its dtype, a Hugging
    Face config's attention implementation, the precision or the ranks."""
    from lightning_remat.tuning.study import study_name_for

    def name(model, **kwargs):
        return study_name_for(model, torch.device("cpu"), 2**30, "auto", "3x32x32", **kwargs)

    base = name(SizedConvNet(channels=8))
    assert name(SizedConvNet(channels=8)) == base
    assert name(SizedConvNet(channels=16)) != base
    assert name(SizedConvNet(channels=8).double()) != base
    assert name(SizedConvNet(channels=8), precision="bf16-mixed") != base
    assert name(SizedConvNet(channels=8), ranks=2) != base
    assert name(SizedConvNet(channels=8), offload=False) != base
    from importlib.metadata import version

    assert base.endswith(f"|lightning-remat {version('lightning_remat')}")  # a release plans otherwise
    # A budget read from the device's free memory is named as such, not by one run's reading.
    free = study_name_for(SizedConvNet(channels=8), torch.device("cpu"), None, "auto", "3x32x32")
    assert "|free|" in free and free != base
    transformers = pytest.importorskip("transformers")

    def gpt2(attention):
        config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
                                         attn_implementation=attention)
        return transformers.GPT2LMHeadModel(config)

    assert name(gpt2("eager")) == name(gpt2("eager")) != name(gpt2("sdpa"))


def test_a_trial_measured_over_its_budget_is_planned_again_and_measured_again(tmp_path, monkeypatch):
    """A remat trial whose step measures over the budget is not taken as infeasible at once:
    its input is planned again with the margin raised by what it measured over, and the
    new plan's steps are measured; here the meter reads the first step 4 KiB over."""
    import lightning_remat.lightning.trial as trial_module
    from lightning_remat.lightning.trial import PLAIN

    model = SubmoduleStepNet(batch_size=16, channels=16, image=32)
    captured = {}
    real = trial_module.peak_bytes
    readings = []

    def first_over(step, device):
        value = real(step, device)
        readings.append(value)
        if len(readings) == 1 and captured.get("budget"):
            return max(value, captured["budget"] + 4096)
        return value

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            def trial(solver, budget):
                return LightningTrial(trainer, pl_module, batch_arg_name="batch_size", steps_per_trial=1,
                                      solver=solver, settings=_search_settings(trainer, budget))(16)

            plain = trial(PLAIN, 2**30)
            captured["budget"] = budget = int(0.6 * plain.peak_bytes)
            readings.clear()
            monkeypatch.setattr(trial_module, "peak_bytes", first_over)
            captured["result"] = trial("auto", budget)
            raise pl.utilities.exceptions._TunerExitException()

    from lightning_remat import RematStrategy

    strategy = RematStrategy(memory_budget="60%", solver="auto", offload=False, cache_dir=tmp_path / "c")
    small_trainer(tmp_path, max_steps=1, callbacks=[Probe()], strategy=strategy).fit(model)
    result = captured["result"]
    assert len(readings) == 2  # the first plan's step, then the new plan's
    assert result.feasible and result.peak_bytes == readings[-1] <= captured["budget"]


class DecoderWithItsCache(pl.LightningModule):
    """A Hugging Face decoder as its config ships it (``use_cache=True``), on token batches."""

    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
        self.model = transformers.GPT2LMHeadModel(config)
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        from torch.utils.data import DataLoader, TensorDataset

        ids = torch.randint(0, 64, (64, 32), generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size)


@pytest.mark.slow
def test_the_shape_family_of_a_decoder_with_its_cache_on_is_captured_op_by_op(tmp_path):
    """The search's shape family is captured as the planner captures a call: with the
    decoder's default cache off. With it on, torch.export failed on the DynamicCache, the
    family fell back to the submodules, every remat trial reused that coarse capture and
    remat's answer was no larger than plain training's (GPT-2 at a budget where plain fits
    batch 8: 8 against 21 op by op, benchmarks/batch_search.py)."""
    from lightning_remat import RematStrategy
    from lightning_remat.graph.trace import EXPORT

    model = DecoderWithItsCache()
    captured = {}

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            trial = LightningTrial(trainer, pl_module, batch_arg_name="batch_size", steps_per_trial=1,
                                   solver="auto", settings=_search_settings(trainer, 2**30))
            family = trial.profile_family([2, 4])
            captured["kind"], captured["family"] = trial.family_traced.kind, len(family)
            captured["vertices"] = len(family[0])
            captured["result"] = trial(6)
            captured["use_cache"] = pl_module.model.config.use_cache
            raise pl.utilities.exceptions._TunerExitException()

    strategy = RematStrategy(memory_budget=2**30, offload=False, cache_dir=tmp_path / "c")
    with pytest.warns(UserWarning, match="cache of past keys and values"):
        small_trainer(tmp_path, max_steps=1, callbacks=[Probe()], strategy=strategy).fit(model)
    assert captured["kind"] == EXPORT and captured["family"] == 2
    assert captured["vertices"] > 50  # op by op, not the fallback's few submodules
    assert captured["result"].feasible
    assert captured["use_cache"] is True  # the user's config as it was


class MeteredConvNet(SizedConvNet):
    """Each fit step's forward and backward (Lightning's closure) measured with the search's
    meter while ``peaks`` is a list; ``skip`` steps unmeasured first (a planning step)."""

    peaks: list[int] | None = None
    skip = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if self.peaks is None or self.skip > 0:
            self.skip -= self.peaks is not None
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        from lightning_remat.measure.peak import peak_bytes

        def metered():
            out = [None]

            def step():
                out[0] = optimizer_closure()

            self.peaks.append(peak_bytes(step))
            return out[0]

        optimizer.step(closure=metered)


def _fit_peak(model, root, strategy, batch_size, skip=0):
    """The highest measured step of a two-step fit at ``batch_size`` (after ``skip``)."""
    model.batch_size, model.peaks, model.skip = batch_size, [], skip
    try:
        small_trainer(root, max_steps=2 + skip, strategy=strategy).fit(model)
    finally:
        peaks, model.peaks = model.peaks, None
    return max(peaks)


def test_a_trial_measures_what_the_fit_step_holds_on_a_model_that_trained_before(tmp_path):
    """On a model that trained before (its gradients left from the last step), a trial's
    measured peak is the fit step's to the byte, so the search's answer trains within the
    budget: Lightning's step frees the old gradients before its backward and allocates its
    own, which a trial that accumulated into the old ones neither planned for nor measured."""
    from lightning_remat import RematStrategy

    torch.manual_seed(0)
    model = MeteredConvNet(batch_size=4, channels=8, image=16, samples=96)
    budget = _fit_peak(model, tmp_path / "plain", "auto", 4)  # plain training fits exactly 4
    assert all(p.grad is not None for p in model.parameters())  # left by the fit's last step
    report = find_max_batch_size(
        small_trainer(tmp_path / "search", max_epochs=1, strategy=RematStrategy(memory_budget=budget)),
        model, init_val=4, max_val=24, steps_per_trial=1, progress_bar=False)
    assert all(p.grad is not None for p in model.parameters())  # the search left them as they were
    plain, remat = report.plain, report.remat
    assert plain.largest_feasible == 4
    (at_b,) = [r for r in plain.trials if r.batch_size == 4]
    assert at_b.peak_bytes == budget
    answer = remat.largest_feasible
    assert answer is not None and answer >= 4
    trained = _fit_peak(model, tmp_path / "search", RematStrategy(memory_budget=budget), answer, skip=1)
    (trial,) = [r for r in remat.trials if r.batch_size == answer] or [at_b]
    # The trial's step is the first at its size; the fit's later steps may hold less (the
    # plain fit's second step measured less than its first), not more.
    assert trained <= trial.peak_bytes <= budget


def test_a_fit_with_the_search_draws_the_random_numbers_a_fit_without_it_draws(tmp_path):
    """The search trains nothing, randomness included: the first step of a fit that searched
    sees torch's generator as the same fit at that size without the search does (its
    dropout masks, a shuffled loader's order)."""
    seen = []

    class Generator(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(torch.get_rng_state())

    finder = RematBatchSizeFinder(memory_budget="2MiB", solver="plain", init_val=2, max_val=16,
                                  steps_per_trial=1, progress_bar=False)
    torch.manual_seed(0)
    searched = SizedConvNet(batch_size=2)
    small_trainer(tmp_path / "search", max_steps=1, callbacks=[finder, Generator()]).fit(searched)
    torch.manual_seed(0)
    plain = SizedConvNet(batch_size=searched.batch_size)
    small_trainer(tmp_path / "plain", max_steps=1, callbacks=[Generator()]).fit(plain)
    assert searched.batch_size != 2  # the search ran and changed the size
    assert torch.equal(seen[0], seen[1])
