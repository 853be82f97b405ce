"""``RematBatchSizeFinder``: the largest batch that fits the budget, re-planning for each size.

Lightning's ``BatchSizeFinder`` doubles the batch until an OOM and bisects; it cannot know
that another rematerialization plan would make a bigger batch fit. This callback runs the
same kind of search (an Optuna study, see :mod:`lightning_remat.tuning`) where a trial at
batch size ``b`` plans for the budget at ``b`` and measures real training steps
(:class:`~lightning_remat.lightning.trial.LightningTrial`). Before searching it profiles the
model once at two sizes (the shape family) and predicts the largest size that fits from the
graphs derived for each size, so the trials measure around the prediction. The same search
with solver ``"plain"`` (no rematerialization) gives plain training's maximum for the report.

Conventions follow ``pytorch_lightning.callbacks.BatchSizeFinder``: ``batch_arg_name``
names an attribute of the model, its ``hparams`` or the datamodule (found with Lightning's
``lightning_hasattr``), the search runs in ``on_fit_start`` and the largest feasible size is
written back with ``lightning_setattr``.

Under ``remat_ddp`` and ``remat_fsdp`` the search spans the ranks
(:func:`~lightning_remat.tuning.ranks.run_search_across_ranks`): one study on rank zero, every
rank runs each trial's steps, a size fits only when it fits on every rank (the worst peak
over ranks), and every rank writes the same answer, so every rank's dataloader gets it.
Lightning's ``BatchSizeFinder`` refuses distributed strategies because the ranks would have
to agree on an out-of-memory error; here each rank measures, and the ranks compare on a
group of their own. A rank that runs out of memory before one of the step's collectives
leaves the others in it until ``collective_timeout``; then every rank stops with one
:class:`~lightning_remat.errors.SearchStoppedError` (docs/design.md section 7).

Lightning's private names used (each commented where used) are ones its own
``BatchSizeFinder`` uses: ``fit_loop._data_source``, ``fit_loop._combined_loader`` and
``_TunerExitException``; pyproject.toml bounds ``pytorch-lightning`` to the versions tested,
and a test fails when one is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks.callback import Callback
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.utilities.exceptions import MisconfigurationException, _TunerExitException
from pytorch_lightning.utilities.parsing import (
    lightning_getattr,
    lightning_hasattr,
    lightning_setattr,
)
from pytorch_lightning.utilities.rank_zero import rank_zero_info

from lightning_remat.budget import Budget
from lightning_remat.cache import default_cache_dir
from lightning_remat.device import default_budget
from lightning_remat.graph.ir import Graph
from lightning_remat.lightning.strategy import RematHooks
from lightning_remat.lightning.trial import (
    PLAIN,
    LightningTrial,
    SearchSettings,
    collectives_bounded,
)
from lightning_remat.measure.peak import collector_settled
from lightning_remat.messages import DistributedRanks, world_size
from lightning_remat.planner import PlanSettings
from lightning_remat.planner.settings import planning_summary
from lightning_remat.report import BatchSizeReport
from lightning_remat.solvers import SOLVERS, min_budget, simulate, solve
from lightning_remat.solvers.policy import solver_options
from lightning_remat.solvers.scoring import model_margin
from lightning_remat.tuning.predict import predict_largest, predict_largest_by_projection
from lightning_remat.tuning.ranks import run_search_across_ranks
from lightning_remat.tuning.search import (
    SearchResult,
    TrialFn,
    TrialRecord,
    TrialResult,
    bracket,
    check_search_args,
    run_search,
)
from lightning_remat.tuning.study import default_storage, study_name_for


def _sample_shape(batch: Any) -> str:
    shapes: list[str] = []

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            shapes.append("x".join(str(s) for s in value.shape[1:]) or "scalar")
        elif isinstance(value, Mapping):
            for k in sorted(value, key=str):
                visit(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(batch)
    return ",".join(shapes)


class RematBatchSizeFinder(Callback):
    """Finds the largest batch size that trains within the memory budget with
    rematerialization, and plain training's largest beside it.

    Args:
        memory_budget: bytes or a size string (``"6GiB"``); default: the RematStrategy's
            budget, else free device memory less 10% on CUDA. Required on CPU (nothing else
            limits memory there). A relative budget (``"60%"``) is refused: it would grow
            with the batch.
        solver: default: the RematStrategy's solver, else ``"auto"``.
        batch_arg_name: the attribute holding the batch size, on the model, its ``hparams``
            or the datamodule (as ``BatchSizeFinder``).
        init_val: the first size tried; the search doubles from it.
        max_val: the largest size tried.
        steps_per_trial: measured training steps per trial.
        max_trials: at most this many trials per search in one call.
        granularity: stop when the largest feasible and smallest infeasible size are this
            close (1: the exact maximum).
        compare_plain: also search plain training's maximum (solver ``"plain"``) for the report.
        storage: an Optuna storage URL; default ``sqlite:///<default_root_dir>/lightning_remat_cache/batch_size.db``,
            so an interrupted search resumes.
        study_name: prefix of the study names (default: model class, device, budget, solver,
            input shape).
        progress_bar: show a tqdm bar per search.
        collective_timeout: across ranks, seconds a collective of a trial's step may wait
            for the other ranks (``torch.distributed.set_timeout`` during each trial,
            restored after): a rank that ran out of memory before a collective leaves the
            others waiting in it this long, then the search stops on every rank with a
            :class:`~lightning_remat.errors.SearchStoppedError`. Raise it where ranks
            legitimately wait longer for each other within one step.

    After the search, ``report`` holds the :class:`~lightning_remat.report.BatchSizeReport`
    (``print(finder.report)`` shows the table) and ``optimal_batch_size`` the size written.

    Example::

        finder = RematBatchSizeFinder(init_val=8, steps_per_trial=2)
        trainer = Trainer(strategy=RematStrategy(memory_budget="20GiB"), callbacks=[finder])
        trainer.fit(model)  # searches, sets model.batch_size, then trains with it
    """

    def __init__(
        self,
        memory_budget: int | str | None = None,
        solver: str | None = None,
        batch_arg_name: str = "batch_size",
        init_val: int = 2,
        max_val: int = 8192,
        steps_per_trial: int = 3,
        max_trials: int = 25,
        granularity: int = 1,
        compare_plain: bool = True,
        storage: str | None = None,
        study_name: str | None = None,
        progress_bar: bool = True,
        collective_timeout: float = 120.0,
    ) -> None:
        check_search_args(init_val, max_val, granularity)
        if not isinstance(steps_per_trial, int) or steps_per_trial < 1:
            raise ValueError(f"steps_per_trial={steps_per_trial!r} must be an int >= 1")
        if solver is not None and solver not in SOLVERS:
            raise ValueError(f"solver={solver!r}: choose one of {sorted(SOLVERS)}")
        Budget.of(memory_budget).absolute(_WHY_BYTES)
        self.memory_budget = memory_budget
        self.solver = solver
        self.batch_arg_name = batch_arg_name
        self.init_val, self.max_val = init_val, max_val
        self.steps_per_trial, self.max_trials, self.granularity = steps_per_trial, max_trials, granularity
        self.compare_plain = compare_plain
        self.storage = storage
        self.study_name = study_name
        self.progress_bar = progress_bar
        if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)) \
                or not collective_timeout > 0:
            raise ValueError(f"collective_timeout={collective_timeout!r} must be a number of seconds > 0")
        self.collective_timeout = float(collective_timeout)
        self.report: BatchSizeReport | None = None
        self.optimal_batch_size: int | None = None
        self._early_exit = False

    # ---- Lightning hooks ------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str | None = None) -> None:
        if isinstance(trainer.strategy, ParallelStrategy) and not isinstance(trainer.strategy, RematHooks):
            raise MisconfigurationException(
                f"RematBatchSizeFinder does not support {type(trainer.strategy).__name__}; across ranks "
                "it runs under strategy='remat_ddp' or 'remat_fsdp'")
        # Private, as in BatchSizeFinder.setup: whether fit's dataloader comes from a module.
        if stage == "fit" and not trainer.fit_loop._data_source.is_module():
            raise MisconfigurationException(
                "RematBatchSizeFinder cannot change the batch size of dataloaders passed directly to "
                "`.fit()`: define train_dataloader in the LightningModule or a LightningDataModule"
            )
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise MisconfigurationException(
                f"Field {self.batch_arg_name} not found in `model`, `datamodule`, nor their `hparams` "
                "attributes: add it, or pass batch_arg_name="
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    # ---- the search -----------------------------------------------------------------------
    def _settings(self, trainer: pl.Trainer) -> SearchSettings:
        """The search's settings: this callback's arguments, else the RematStrategy's."""
        strategy = trainer.strategy
        remat_strategy = strategy if isinstance(strategy, RematHooks) else None
        budget = self.memory_budget
        plan = PlanSettings(solver=self.solver or "auto")
        if remat_strategy is not None:
            if budget is None:
                budget = remat_strategy.memory_budget
            plan = dataclasses.replace(remat_strategy.remat_settings, solver=self.solver or remat_strategy.solver)
        device = strategy.root_device
        written = Budget.of(budget)
        written.absolute(_WHY_BYTES)  # a fraction of the plain peak is refused
        budget_bytes = written.resolve(free_memory=lambda: default_budget(device))
        if budget_bytes is None:
            raise MisconfigurationException(
                "RematBatchSizeFinder on CPU needs memory_budget= (bytes or '512MiB'): nothing "
                "raises out-of-memory there, so only the budget can bound the batch size"
            )
        # The planner gets the budget as written, None included (so its plan-cache key
        # matches the strategy's and training at the found size reuses the trial's plan).
        plan = dataclasses.replace(plan, memory_budget=budget)
        cache_dir = remat_strategy.cache_dir if remat_strategy is not None else None
        return SearchSettings(
            plan=plan, budget_bytes=budget_bytes, device=device,
            target=remat_strategy.target if remat_strategy is not None else None,
            cache_dir=Path(cache_dir or default_cache_dir(trainer.default_root_dir)),
            budget_from_device=written.from_device,
        )

    def _search(self, trainer: pl.Trainer, pl_module: pl.LightningModule, trial_fn: TrialFn,
                solver: str, label: str, settings: SearchSettings, init_val: int, sample_shape: str,
                hint: int | list[int] | None = None, floor: int = 0,
                repredict: Callable[[list[TrialRecord]], int | None] | None = None) -> SearchResult:
        storage = self.storage or default_storage(trainer.default_root_dir)
        budget = None if settings.budget_from_device else settings.budget_bytes
        name = study_name_for(pl_module, settings.device, budget, solver, sample_shape,
                              precision=str(trainer.precision), ranks=trainer.world_size,
                              offload=settings.plan.offload)
        if self.study_name:
            name = f"{self.study_name}|{name}"
        search_args = dict(
            init_val=init_val, max_val=self.max_val, granularity=self.granularity,
            max_trials=self.max_trials, storage=storage, study_name=name, label=label,
            solver=solver, progress_bar=self.progress_bar, hint=hint, floor=floor, repredict=repredict,
        )
        if world_size() > 1:
            # Its own gloo group for the verdicts, and each trial's collectives bounded in time.
            def bounded(batch_size: int) -> TrialResult:
                with collectives_bounded(trainer.strategy, self.collective_timeout):
                    return trial_fn(batch_size)

            return run_search_across_ranks(bounded, DistributedRanks(own_group=True), **search_args)
        return run_search(trial_fn, **search_args)

    def _predict(self, trial: TrialFn, solver: str, settings: SearchSettings, init_val: int,
                 max_val: int | None = None, excess: int = 0) -> int | None:
        """The largest size up to ``max_val`` (default: the finder's) predicted to fit, from
        the graphs the shape family gives each size (None without a family): plain training
        by the plain peak fitted to the profiles, a solver by where its smallest budget on
        the derived graphs crosses the budget
        (:func:`~lightning_remat.tuning.predict.predict_largest_by_projection`). ``excess``:
        what trials measured above their plans' predicted peaks, added to the model's margin
        of every derived graph (``meta.measured_excess_bytes``, as the planner raises it
        after a step measured over its prediction)."""
        if not isinstance(trial, LightningTrial) or not trial.family:
            return None
        budget = settings.budget_bytes
        options = solver_options(solver, settings.device, settings.plan.offload)
        max_val = self.max_val if max_val is None else max_val

        def derived(size: int) -> Graph:
            graph = trial.derived(size)
            if excess > 0:
                graph.meta.measured_excess_bytes = excess
            return graph

        if solver == PLAIN:
            def plain_fits(size: int) -> bool:
                graph = trial.derived(size)
                return (graph.meta.plain_peak_bytes or simulate(graph).peak_bytes) <= budget

            return predict_largest(plain_fits, init_val, max_val, self.granularity)
        # A solver's smallest budget, and the plan that has it run at larger sizes, give the
        # crossing in a few solves, where a search on fits-or-not solves at every size it
        # doubles to.
        def least_at(size: int) -> tuple[int, Callable[[int], int]]:
            graph = derived(size)
            least = min_budget(graph, solver, **options)
            plan = solve(graph, least, solver, **options)

            def peak(other: int) -> int:
                graph = derived(other)
                return simulate(graph, plan).peak_bytes + model_margin(graph)

            return least, peak

        return predict_largest_by_projection(least_at, budget, init_val, max_val, self.granularity)

    def _repredict(self, trial: TrialFn, solver: str, settings: SearchSettings,
                   floor: int) -> Callable[[list[TrialRecord]], int | None]:
        """What the remat search predicts after a prediction measured infeasible: where the
        trials measured above their plans' predicted peaks (a model error the profiles do
        not show: the first prediction did not count it), the prediction again with that
        excess as margin, inside the bracket; None where the excess is no larger than at the
        last prediction (the same prediction) or the bracket is closed."""
        learned = [0]

        def repredict(records: list[TrialRecord]) -> int | None:
            excess = max((r.peak_bytes - r.predicted_peak_bytes for r in records
                          if r.peak_bytes is not None and r.predicted_peak_bytes is not None), default=0)
            if excess <= learned[0]:
                return None
            learned[0] = excess
            br = bracket([(r.batch_size, r.feasible) for r in records], floor)
            lo, hi = br.largest_feasible, br.smallest_infeasible
            if hi is None or hi - lo <= self.granularity:
                return None
            start = lo or min(self.init_val, hi - 1)
            return self._predict(trial, solver, settings, start, max_val=hi - 1, excess=excess)

        return repredict

    def family_sizes(self) -> list[int]:
        """The batch sizes the shape family is profiled at: ``init_val`` and half of it (2
        when ``init_val`` is 1), so the two profiles give each cost's line."""
        return sorted({self.init_val, max(1, self.init_val // 2) if self.init_val > 1 else 2})

    def _say(self, trainer: pl.Trainer) -> Callable[[str], None]:
        """One info line on rank zero per phase of the search, unless ``progress_bar`` is
        off or the Trainer shows no progress bar."""
        if not self.progress_bar or trainer.progress_bar_callback is None:
            return lambda line: None
        return lambda line: rank_zero_info(f"lightning-remat: {line}")

    def make_trial(self, trainer: pl.Trainer, pl_module: pl.LightningModule, solver: str,
                   settings: SearchSettings) -> TrialFn:
        """The trial function for one solver (override to measure differently)."""
        return LightningTrial(
            trainer, pl_module, batch_arg_name=self.batch_arg_name,
            steps_per_trial=self.steps_per_trial, solver=solver, settings=settings,
        )

    def scale_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> BatchSizeReport:
        """Run the searches, write the answer to ``batch_arg_name`` and keep the report."""
        settings = self._settings(trainer)
        original = lightning_getattr(pl_module, self.batch_arg_name)
        bar = trainer.progress_bar_callback
        if bar is not None:
            bar.disable()
        settled = contextlib.ExitStack()
        settled.enter_context(collector_settled())  # the CPU meter collects before every step
        # The search trains nothing, randomness included: the batches it reads outside its
        # trials (a DataLoader's iterator draws its seed from torch's generator) left the fit
        # other dropout masks than the same fit without the search.
        device = settings.device
        settled.enter_context(torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []))
        try:
            sample_shape = ""
            with contextlib.suppress(Exception):  # the name is only a label; never fail on it
                loader = trainer.fit_loop._data_source.dataloader()  # private: see LightningTrial.batch
                sample_shape = _sample_shape(next(iter(loader)))
            say = self._say(trainer)
            started = time.perf_counter()
            solver = settings.plan.solver
            remat_trial = self.make_trial(trainer, pl_module, solver, settings)
            family: list[Graph] = []
            # Across ranks every rank must profile together; the shape family is one
            # process's shortcut, so a distributed search profiles each trial instead.
            if isinstance(remat_trial, LightningTrial) and world_size() == 1:
                sizes = self.family_sizes()
                say(f"batch-size search: profiling at batch sizes {sizes} (once for every trial)")
                family = remat_trial.profile_family(sizes)
            plain = None
            init_val = self.init_val
            if self.compare_plain and solver != PLAIN:
                plain_trial = self.make_trial(trainer, pl_module, PLAIN, settings)
                if isinstance(plain_trial, LightningTrial):
                    plain_trial.family = family
                hint = self._predict(plain_trial, PLAIN, settings, self.init_val)
                say(f"batch-size search (plain): predicted largest {hint}; measuring around it")
                plain = self._search(trainer, pl_module, plain_trial, PLAIN, "plain", settings, self.init_val,
                                     sample_shape, hint)
                # Remat fits at least what plain training fits (same budget): start there.
                if plain.largest_feasible and plain.largest_feasible <= self.max_val:
                    init_val = plain.largest_feasible
            # Two predictions: the solver's, then plain training's (its peak is fitted to
            # measured peaks, so it holds even where the simulator and a plan's measured
            # peak disagree; every solver fits at least what plain training fits).
            predicted = self._predict(remat_trial, solver, settings, init_val)
            fallback = self._predict(remat_trial, PLAIN, settings, init_val) if solver != PLAIN else None
            hints = [h for h in (predicted, fallback) if h]
            label = "remat" if solver != PLAIN else PLAIN
            say(f"batch-size search ({label}): predicted largest {predicted}"
                + (f" (plain training: {fallback})" if fallback else "") + "; measuring around it")
            # Every size plain training fits at this budget fits with a plan too: not measured again.
            floor = plain.largest_feasible if plain is not None and plain.largest_feasible else 0
            repredict = self._repredict(remat_trial, solver, settings, floor) if solver != PLAIN else None
            remat = self._search(trainer, pl_module, remat_trial, solver, label, settings, init_val,
                                 sample_shape, hints, floor=floor, repredict=repredict)
            seconds = time.perf_counter() - started
            trials = remat.trials_run + (plain.trials_run if plain is not None else 0)
            step = family[-1].meta.step_seconds if family else None
            say(f"batch-size search: {trials} trials, largest fit {remat.largest_feasible}; "
                + planning_summary(seconds, step)
                + (f" at batch {family[-1].meta.batch_size}" if step else ""))
        finally:
            settled.close()
            if bar is not None:
                bar.enable()
            lightning_setattr(pl_module, self.batch_arg_name, original)
        self.report = BatchSizeReport(
            model=type(pl_module).__name__, device=str(settings.device),
            budget_bytes=settings.budget_bytes, remat=remat, plain=plain,
        )
        self.optimal_batch_size = remat.largest_feasible
        if remat.largest_feasible is None:
            rank_zero_info("lightning-remat: no batch size fits the budget, not even "
                           f"{remat.smallest_infeasible}; batch size left at {original}")
        else:
            lightning_setattr(pl_module, self.batch_arg_name, remat.largest_feasible)
        if not self._early_exit:  # find_max_batch_size returns the report to its caller instead
            rank_zero_info(self.report.table())
        # Private, as BatchSizeFinder's _reset_dataloaders: a dataloader built before this hook
        # (configure_optimizers reading trainer.estimated_stepping_batches builds one) is
        # dropped, so the fit loop builds it again with the new size.
        trainer.fit_loop._combined_loader = None
        if self._early_exit:
            raise _TunerExitException()  # private: how BatchSizeFinder ends fit after its search
        return self.report


_WHY_BYTES = "grows with the batch size: the batch-size search needs bytes"


def find_max_batch_size(
    trainer: pl.Trainer,
    model: pl.LightningModule,
    datamodule: pl.LightningDataModule | None = None,
    **finder_kwargs: Any,
) -> BatchSizeReport:
    """Search without adding the callback yourself (as Lightning's ``Tuner.scale_batch_size``):
    runs ``trainer.fit`` up to ``on_fit_start``, searches, writes the largest feasible size to
    ``batch_arg_name`` and returns the report. ``finder_kwargs`` are
    :class:`RematBatchSizeFinder`'s arguments.

    Examples::

        >>> import tempfile
        >>> import torch
        >>> from torch import nn
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> import pytorch_lightning as pl
        >>> from lightning_remat import RematStrategy, find_max_batch_size
        >>> class Regressor(pl.LightningModule):
        ...     def __init__(self, batch_size=16):
        ...         super().__init__()
        ...         self.batch_size = batch_size  # the search writes the size it finds here
        ...         self.net = nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(32, 32), nn.Tanh())])
        ...     def training_step(self, batch, batch_idx):
        ...         inputs, targets = batch
        ...         return nn.functional.mse_loss(self.net(inputs), targets)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.net.parameters(), lr=0.01)
        ...     def train_dataloader(self):
        ...         data = TensorDataset(torch.randn(1024, 32), torch.randn(1024, 32))
        ...         return DataLoader(data, batch_size=self.batch_size)
        >>> model = Regressor()
        >>> with tempfile.TemporaryDirectory() as root:  # the search's SQLite study lives here
        ...     trainer = pl.Trainer(strategy=RematStrategy(memory_budget="256KiB"),
        ...                          accelerator="cpu", max_epochs=1, default_root_dir=root,
        ...                          logger=False, enable_checkpointing=False,
        ...                          enable_progress_bar=False, enable_model_summary=False)
        ...     report = find_max_batch_size(trainer, model, init_val=16, max_val=1024,
        ...                                  steps_per_trial=1, progress_bar=False)
        >>> model.batch_size == report.batch_size
        True
        >>> report.batch_size >= report.plain.largest_feasible  # plain training's largest
        True
        >>> print(report.table())  # doctest: +ELLIPSIS
        lightning-remat batch-size search: Regressor on cpu, budget 256.00 KiB
        ...
    """
    finder = RematBatchSizeFinder(**finder_kwargs)
    finder._early_exit = True
    trainer.callbacks = [finder, *trainer.callbacks]
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        trainer.callbacks = [cb for cb in trainer.callbacks if cb is not finder]
    if finder.report is None:
        raise RuntimeError("the batch-size search did not run (is fast_dev_run set, or did fit fail?)")
    return finder.report
