"""The largest feasible batch size: an Optuna study over one integer (docs/design.md section 7).

A *trial* is a function ``batch_size -> TrialResult``: plan for that batch size, run a few
real steps and measure the peak (see :mod:`lightning_remat.lightning.trial` for the
Lightning trial). This module holds what does not depend on Lightning:

- :class:`BisectionSampler`, an Optuna sampler that exploits monotone feasibility (a batch
  that fits means every smaller one fits): it doubles from ``init_val`` until the first
  infeasible size, then bisects between the largest feasible and the smallest infeasible
  size seen. Its proposals depend only on the finished trials stored in the study, so a
  study resumed from SQLite continues where it stopped and never repeats a size.
- :func:`run_search`, which drives the study: one Optuna trial per size the sampler
  proposes, infeasible results (no plan, OOM, peak over budget) recorded as completed trials
  that violate the constraint ``within_budget``, never as crashes.
- :func:`run_search_across_ranks`, the same search for data-parallel ranks: one study on
  rank zero, every rank runs each trial, a size fits only where it fits on every rank;
- :class:`SearchResult`, what one search found (rendered by
  :class:`lightning_remat.report.BatchSizeReport`).

Objectives (Optuna multi-objective, both maximised): the batch size and the measured
samples per second, so ``study.best_trials`` is the Pareto front of feasible trials.

The predictions that start a search (:mod:`.predict`), the same search across ranks
(:mod:`.ranks`) and the study's storage and names (:mod:`.study`) have modules of their own.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState

from lightning_remat.device import free_device_memory, is_out_of_memory
from lightning_remat.errors import RematInfeasibleError, warn_caller
from lightning_remat.tuning.study import (
    PARAM,
    StaleTrials,
    load_study,
    optuna_logs_quiet,
    trial_progress,
)


@dataclass
class TrialResult:
    """What one trial found at one batch size.

    ``seconds`` is the wall time of one training step (measured steps after the first);
    ``predicted_extra_seconds`` the plan's predicted recomputation/offload time per step.
    """

    feasible: bool
    peak_bytes: int | None = None
    seconds: float | None = None
    reason: str = ""
    predicted_extra_seconds: float | None = None
    predicted_peak_bytes: int | None = None
    solver: str | None = None
    reserved_bytes: int | None = None
    """CUDA: the caching allocator's reserved peak beside ``peak_bytes`` (allocated)."""
    out_of_memory: bool = False
    """The trial ran out of memory (:func:`run_trial_safely`)."""


TrialFn = Callable[[int], TrialResult]


@dataclass
class TrialRecord:
    """A finished trial as the study stores it."""

    number: int
    batch_size: int
    feasible: bool
    peak_bytes: int | None
    seconds: float | None
    reason: str
    predicted_extra_seconds: float | None
    solver: str | None
    predicted_peak_bytes: int | None = None

    @property
    def samples_per_second(self) -> float | None:
        if not self.feasible or not self.seconds:
            return None
        return self.batch_size / self.seconds

    @property
    def extra_seconds_per_sample(self) -> float | None:
        if self.predicted_extra_seconds is None:
            return None
        return self.predicted_extra_seconds / self.batch_size

    @classmethod
    def from_frozen(cls, trial: FrozenTrial) -> TrialRecord:
        attrs = dict(trial.user_attrs.get("result", {}), feasible=trial.user_attrs.get("feasible"))
        return cls(
            number=trial.number,
            batch_size=int(trial.params[PARAM]),
            feasible=bool(attrs.get("feasible", False)),
            peak_bytes=attrs.get("peak_bytes"),
            seconds=attrs.get("seconds"),
            reason=str(attrs.get("reason", "")),
            predicted_extra_seconds=attrs.get("predicted_extra_seconds"),
            solver=attrs.get("solver"),
            predicted_peak_bytes=attrs.get("predicted_peak_bytes"),
        )


PREDICTED = "predicted"
"""The user attribute of a trial enqueued as a prediction of the answer (its size)."""


def predictions(study: Study) -> list[int]:
    """The sizes enqueued as predictions of the answer, in the order they were enqueued."""
    trials = study.get_trials(deepcopy=False)
    return list(dict.fromkeys(int(t.user_attrs[PREDICTED]) for t in trials if PREDICTED in t.user_attrs))


def finished_records(study: Study) -> list[TrialRecord]:
    """Completed trials that carry a batch size and a feasibility verdict, in order."""
    out = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if PARAM in trial.params and "feasible" in trial.user_attrs:
            out.append(TrialRecord.from_frozen(trial))
    return out


@dataclass(frozen=True)
class Bracket:
    """What the finished trials say: every size <= ``largest_feasible`` fits (0 when none
    tried fits), every size >= ``smallest_infeasible`` does not (None when none failed).
    ``monotone`` is False when some feasible size lies above an infeasible one (measurement
    noise); the bracket then trusts the smallest infeasible size."""

    largest_feasible: int
    smallest_infeasible: int | None
    monotone: bool = True


def bracket(records: Sequence[tuple[int, bool]], floor: int = 0) -> Bracket:
    """The bracket of ``(batch_size, feasible)`` pairs. ``floor``: a size known to fit
    without a trial of this search (remat's search: plain training's largest, measured by
    its own search at the same budget), the bracket's lower end unless a trial at or below
    it failed (a measurement is trusted over what was inferred)."""
    infeasible = [b for b, ok in records if not ok]
    hi = min(infeasible) if infeasible else None
    feasible = [b for b, ok in records if ok]
    below = [b for b in feasible if hi is None or b < hi]
    monotone = len(below) == len(feasible)
    lo = max(below, default=0)
    if floor > lo and (hi is None or floor < hi):
        lo = floor
    return Bracket(lo, hi, monotone)


def next_batch_size(
    records: Sequence[tuple[int, bool]], init_val: int, max_val: int, granularity: int = 1,
    hint: int | Sequence[int] | None = None, floor: int = 0,
) -> int | None:
    """The next size to try, or None when the answer is known.

    ``hint``: the size predicted to be the largest that fits (:func:`predict_largest`), or
    several predictions, most hopeful first. Each still inside the bracket is tried, then a
    prediction's neighbour when the prediction is an end of the bracket (``granularity``
    above the largest fitting size, else below the smallest failing one): a right
    prediction closes the bracket in two trials. After them the rules below go on from
    the trials so far.

    Doubling phase (no infeasible size yet): ``init_val``, then twice the largest feasible
    size, capped at ``max_val``. Bisection phase: the midpoint of the bracket, until the
    largest feasible and the smallest infeasible size are ``granularity`` apart (1: exact).
    These are the steps of Lightning's ``BatchSizeFinder(mode="binsearch")`` (double until
    the first OOM, then bisect), so on the same feasibility it tries the same sizes, but
    read from the stored trials rather than from loop variables.

    ``floor``: a size known to fit without a trial (:func:`bracket`): nothing at or below
    it is tried.
    """
    br = bracket(records, floor)
    lo, hi = br.largest_feasible, br.smallest_infeasible
    if hi is not None and hi - lo <= granularity:
        return None
    verdicts = dict(records)

    def open_(size: int) -> bool:  # inside the bracket, so its verdict would be news
        return 1 <= size <= max_val and size > lo and (hi is None or size < hi) and size not in verdicts

    guesses = [min(max(g, 1), max_val) for g in ([] if hint is None else [hint] if isinstance(hint, int) else hint)]
    for guess in guesses:
        if open_(guess):
            return guess
    # A prediction that fit: from the bracket's fitting end, its neighbour, then steps
    # doubling with the distance already covered (rather than bisect a bracket a wrong
    # prediction opened). None fit: the neighbour below a prediction that failed.
    fitting = [g for g in guesses if verdicts.get(g) and g <= lo]
    if fitting:
        gallop = lo + max(granularity, 2 * (lo - max(fitting)))
        if open_(gallop):
            return gallop
    if not fitting and hi in guesses and open_(hi - granularity):
        return hi - granularity
    if hi is None:
        if lo == 0:
            return min(init_val, max_val)
        if lo >= max_val:
            return None
        return min(2 * lo, max_val)
    if hi - lo <= granularity:
        return None
    return (lo + hi) // 2


class BisectionSampler(BaseSampler):
    """Optuna sampler for the largest feasible batch size under monotone feasibility.

    Feasibility is monotone in the batch size (activations grow with it; a plan for a
    bigger batch fits a smaller one), so the search needs only the bracket
    ``[largest feasible, smallest infeasible)``: double from ``init_val`` until the first
    infeasible size, then bisect the bracket until its ends are ``granularity`` apart. That
    gives the exact maximum in at most ``log2(max / init_val) + 1 + log2(max)`` trials.

    The sampler keeps no state of its own: each proposal is computed from the study's
    completed trials (their ``batch_size`` parameter and ``feasible`` user attribute), so a
    study loaded from storage after an interruption continues where it stopped. Failed
    trials (crashes) are not counted, so their size is tried again. Predictions of the
    answer are trials :func:`run_search` enqueued (``study.enqueue_trial``, user attribute
    ``predicted``): Optuna runs them first, and the sampler reads them from the study to
    go on from them (:func:`next_batch_size`'s ``hint``).

    Any parameter other than ``batch_size`` is delegated to ``fallback`` (random sampling).
    """

    def __init__(self, init_val: int = 2, max_val: int = 8192, granularity: int = 1,
                 fallback: BaseSampler | None = None, floor: int = 0) -> None:
        check_search_args(init_val, max_val, granularity)
        self.init_val = init_val
        self.max_val = max_val
        self.granularity = granularity
        self.floor = floor
        self._fallback = fallback or optuna.samplers.RandomSampler()

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def proposal(self, study: Study) -> int | None:
        """The size the next trial will get (None: the search is finished)."""
        pairs = [(r.batch_size, r.feasible) for r in finished_records(study)]
        return next_batch_size(pairs, self.init_val, self.max_val, self.granularity, predictions(study),
                               self.floor)

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if param_name != PARAM:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        proposed = self.proposal(study)
        if proposed is None:
            # Asked past the end: re-check the boundary (the answer) rather than fail.
            pairs = [(r.batch_size, r.feasible) for r in finished_records(study)]
            proposed = max(1, bracket(pairs, self.floor).largest_feasible)
        assert isinstance(param_distribution, IntDistribution)
        return int(min(max(proposed, param_distribution.low), param_distribution.high))


def check_search_args(init_val: int, max_val: int, granularity: int) -> None:
    for name, value in (("init_val", init_val), ("max_val", max_val), ("granularity", granularity)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if init_val > max_val:
        raise ValueError(f"init_val={init_val} is above max_val={max_val}; lower init_val or raise max_val")


@dataclass
class SearchResult:
    """One search (one solver): the bracket and every finished trial of the study."""

    label: str
    solver: str
    largest_feasible: int | None
    smallest_infeasible: int | None
    trials: list[TrialRecord]
    trials_run: int
    """Trials this call ran (a resumed study ran the rest before)."""
    study_name: str
    storage: str | None
    monotone: bool = True
    finished: bool = True
    """False when ``max_trials`` stopped the search before the bracket closed."""
    pareto: list[TrialRecord] = field(default_factory=list)
    """Feasible trials no other feasible trial beats in both batch size and samples/s."""
    floor: int = 0
    """The size known to fit without a trial of this search (:func:`bracket`); 0: none."""

    def trial_at(self, batch_size: int | None) -> TrialRecord | None:
        for record in self.trials:
            if record.batch_size == batch_size and record.feasible:
                return record
        return None


def run_trial_safely(trial_fn: TrialFn, batch_size: int) -> TrialResult:
    """Call ``trial_fn``; an OOM or RematInfeasibleError becomes an infeasible result
    (device memory released), any other exception propagates."""
    try:
        return trial_fn(batch_size)
    except RematInfeasibleError as exc:
        return TrialResult(False, reason=f"no plan: {exc}")
    except BaseException as exc:
        if not is_out_of_memory(exc):
            raise
        reason = f"out of memory: {str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__}"
    # Outside the except block: the exception and its traceback's frames (which hold the
    # failed step's tensors) are gone, so their memory can really be released.
    free_device_memory()
    return TrialResult(False, reason=reason, out_of_memory=True)


def run_search(
    trial_fn: TrialFn,
    *,
    init_val: int = 2,
    max_val: int = 8192,
    granularity: int = 1,
    max_trials: int = 25,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str = "lightning_remat-batch_size",
    label: str = "remat",
    solver: str = "",
    progress_bar: bool = False,
    hint: int | Sequence[int] | None = None,
    floor: int = 0,
    repredict: Callable[[list[TrialRecord]], int | None] | None = None,
) -> SearchResult:
    """Find the largest batch size ``trial_fn`` calls feasible (exact within ``granularity``).

    ``storage`` is any Optuna storage (URL such as ``sqlite:///path.db`` or
    ``postgresql://...``); None keeps the study in memory. A study of that name already in
    the storage is continued. ``max_trials`` bounds the trials of this call. ``hint``: the
    size predicted to be the largest that fits, or several, most hopeful first; each is
    enqueued as a trial (:func:`next_batch_size` says what follows them), and one the
    trials before it have already decided is pruned, not measured. ``floor``: a size known
    to fit without a trial (:func:`bracket`; nothing at or below it is measured).
    ``repredict``: called with the finished trials after a prediction measured infeasible;
    a size it returns is the next prediction (a failed prediction says what the prediction
    left out: the caller predicts again with it), None: the search goes on without one.
    After the other trials' failures the bracket's own steps are as short as a new
    prediction would make them, and predicting costs solves.

    A URL gets a storage with Optuna's heartbeat: a trial a killed search left running is
    failed once its heartbeat is older than the grace period (this search waits that long
    for one it finds still running) and retried (``RetryHeartbeatStaleTrialCallback``),
    with one warning. A storage object is used as given.
    """
    check_search_args(init_val, max_val, granularity)
    if not isinstance(max_trials, int) or max_trials < 1:
        raise ValueError(f"max_trials={max_trials!r} must be an int >= 1")
    with optuna_logs_quiet():  # its INFO lines: a study created, a trial finished or pruned
        sampler = BisectionSampler(init_val, max_val, granularity, floor=floor)
        stale = StaleTrials(label)
        study = load_study(storage, study_name, sampler, stale)
        if isinstance(storage, str):  # the storage with a heartbeat
            stale.fail(study)
        guesses = [] if hint is None else [hint] if isinstance(hint, int) else list(hint)

        def predict(guess: int) -> None:
            size = min(max(int(guess), 1), max_val)
            study.enqueue_trial({PARAM: size}, user_attrs={PREDICTED: size}, skip_if_exists=True)

        for guess in guesses:
            predict(guess)
        trials_run = 0

        def objective(trial: optuna.Trial) -> tuple[float, float]:
            nonlocal trials_run
            batch_size = trial.suggest_int(PARAM, 1, max_val)
            if decided(study, batch_size, floor):  # an enqueued prediction the trials before it decided
                raise optuna.TrialPruned(f"batch size {batch_size}: the finished trials decide it")
            trials_run += 1
            result = run_trial_safely(trial_fn, batch_size)
            feasible = bool(result.feasible)
            attrs = {
                "peak_bytes": _int_or_none(result.peak_bytes),
                "seconds": result.seconds, "reason": result.reason,
                "predicted_extra_seconds": result.predicted_extra_seconds,
                "predicted_peak_bytes": _int_or_none(result.predicted_peak_bytes),
                "solver": result.solver,
            }
            # Two attributes, not one per field: each is a storage round trip (a SQLite commit).
            trial.set_user_attr("result", attrs)
            trial.set_user_attr("feasible", feasible)
            trial.set_constraint("within_budget", 0.0 if feasible else 1.0)
            throughput = batch_size / result.seconds if feasible and result.seconds else 0.0
            return float(batch_size), float(throughput)

        bar = trial_progress(progress_bar, label)
        try:
            while trials_run < max_trials:
                proposed = sampler.proposal(study)
                if proposed is None:
                    break
                if bar is not None:
                    br = bracket([(r.batch_size, r.feasible) for r in finished_records(study)])
                    bar.set_postfix_str(f"trying {proposed}, fits {br.largest_feasible or '-'}, "
                                        f"fails {br.smallest_infeasible or '-'}")
                measured = trials_run
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    study.optimize(objective, n_trials=1, catch=())
                if bar is not None:
                    bar.update(trials_run - measured)
                if repredict is not None and trials_run > measured:
                    records = finished_records(study)
                    if records and not records[-1].feasible and records[-1].batch_size in predictions(study):
                        guess = repredict(records)
                        if guess is not None:
                            predict(guess)
        finally:
            if bar is not None:
                bar.close()
        stale.warn(study)  # trials another search left running meanwhile (Optuna retried them)
    records = finished_records(study)
    br = bracket([(r.batch_size, r.feasible) for r in records], floor)
    if not br.monotone:
        warn_caller(
            f"lightning-remat batch-size search ({label}): a size above the smallest infeasible "
            f"one ({br.smallest_infeasible}) was feasible; measurements near the budget are noisy. "
            "The answer trusts the smallest infeasible size.")
    return SearchResult(
        label=label, solver=solver,
        largest_feasible=br.largest_feasible or None,
        smallest_infeasible=br.smallest_infeasible,
        trials=records, trials_run=trials_run, study_name=study_name,
        storage=storage if isinstance(storage, str) or storage is None else type(storage).__name__,
        monotone=br.monotone,
        finished=sampler.proposal(study) is None,
        pareto=pareto_front(study, records), floor=floor,
    )


def decided(study: Study, size: int, floor: int = 0) -> bool:
    """Whether the finished trials (and ``floor``, :func:`bracket`) decide ``size``:
    measured, or outside the bracket."""
    records = finished_records(study)
    br = bracket([(r.batch_size, r.feasible) for r in records], floor)
    return (size <= br.largest_feasible or any(r.batch_size == size for r in records)
            or (br.smallest_infeasible is not None and size >= br.smallest_infeasible))


def pareto_front(study: Study, records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Feasible trials not dominated in (batch size, samples/s), by increasing batch size:
    Optuna's ``study.best_trials`` (the constraint ``within_budget`` leaves the infeasible
    ones out), less trials without a measured time (their samples/s of 0 dominates none)."""
    by_number = {r.number: r for r in records}
    front = [by_number[t.number] for t in study.best_trials if t.number in by_number]
    return sorted((r for r in front if r.samples_per_second is not None), key=lambda r: r.batch_size)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)
