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

Length: the proposal rules (predictions, doubling, bisection), the sampler that reads them
from the study, the prediction that runs the same rules on solves, the driver that records
verdicts (on one process or across ranks) and the records they read back share the bracket,
the study's layout and the trial records, so they stay in one module.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.distributions import BaseDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState
from torch import nn

from lightning_remat.cache import default_cache_dir, is_access_problem, move_aside, sqlite_problem
from lightning_remat.device import device_name, free_device_memory, is_out_of_memory
from lightning_remat.errors import RematInfeasibleError, SearchStoppedError, warn_caller
from lightning_remat.messages import Ranks

PARAM = "batch_size"
"""The one parameter of a batch-size study."""


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


def bracket(records: Sequence[tuple[int, bool]]) -> Bracket:
    """The bracket of ``(batch_size, feasible)`` pairs."""
    infeasible = [b for b, ok in records if not ok]
    hi = min(infeasible) if infeasible else None
    feasible = [b for b, ok in records if ok]
    below = [b for b in feasible if hi is None or b < hi]
    monotone = len(below) == len(feasible)
    return Bracket(max(below, default=0), hi, monotone)


def next_batch_size(
    records: Sequence[tuple[int, bool]], init_val: int, max_val: int, granularity: int = 1,
    hint: int | Sequence[int] | None = None,
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
    """
    br = bracket(records)
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
                 fallback: BaseSampler | None = None) -> None:
        check_search_args(init_val, max_val, granularity)
        self.init_val = init_val
        self.max_val = max_val
        self.granularity = granularity
        self._fallback = fallback or optuna.samplers.RandomSampler()

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def proposal(self, study: Study) -> int | None:
        """The size the next trial will get (None: the search is finished)."""
        pairs = [(r.batch_size, r.feasible) for r in finished_records(study)]
        return next_batch_size(pairs, self.init_val, self.max_val, self.granularity, predictions(study))

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if param_name != PARAM:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        proposed = self.proposal(study)
        if proposed is None:
            # Asked past the end: re-check the boundary (the answer) rather than fail.
            proposed = max(1, bracket([(r.batch_size, r.feasible) for r in finished_records(study)]).largest_feasible)
        assert isinstance(param_distribution, IntDistribution)
        return int(min(max(proposed, param_distribution.low), param_distribution.high))


def predict_largest(fits: Callable[[int], bool], init_val: int, max_val: int,
                    granularity: int = 1) -> int | None:
    """The largest size ``fits(size)`` accepts, found by the search's own steps (double from
    ``init_val``, then bisect) on a prediction instead of a measurement: ``fits`` solves
    the graph derived for that size (:mod:`lightning_remat.graph.scale`), so each step costs
    a solve, not a training step. None when not even the smallest size tried fits."""
    check_search_args(init_val, max_val, granularity)
    records: list[tuple[int, bool]] = []
    while (size := next_batch_size(records, init_val, max_val, granularity)) is not None:
        records.append((size, bool(fits(size))))
        if size == 1 and not records[-1][1]:
            break
    return bracket(records).largest_feasible or None


def predict_largest_by_min_budget(min_budget_at: Callable[[int], int], budget: int, init_val: int,
                                  max_val: int, granularity: int = 1, max_evaluations: int = 10) -> int | None:
    """The largest size whose smallest feasible budget ``min_budget_at(size)`` is within
    ``budget``, in few evaluations. A plan's smallest budget grows about linearly with the
    batch (the activations do; the parameters do not), so after ``init_val`` and twice it
    (or half, while it does not fit) each guess is where the line through the two known
    sizes nearest the budget's crossing meets the budget, and the guess's neighbour
    ``granularity`` further toward the crossing comes next: a right line closes the bracket
    in those two. Where a guess does not halve the bracket, the next is its midpoint, so
    a curved line costs no more than bisection. Each size is evaluated once, at most
    ``max_evaluations``; then the largest known to fit (None when none does)."""
    check_search_args(init_val, max_val, granularity)
    known: dict[int, int] = {}

    def bracket_of() -> tuple[int, int]:
        fitting = [s for s, m in known.items() if m <= budget]
        failing = [s for s, m in known.items() if m > budget]
        return max(fitting, default=0), min(failing, default=max_val + 1)

    def closed(lo: int, hi: int) -> bool:
        return hi - lo <= granularity or lo >= max_val or hi <= 1

    size = init_val
    width = None  # the bracket's width before the last guess
    guessed = False  # whether ``size`` came from the line (its neighbour comes next)
    while size not in known and len(known) < max_evaluations:
        known[size] = int(min_budget_at(size))
        lo, hi = bracket_of()
        if closed(lo, hi):
            break
        neighbour = size + granularity if size == lo else size - granularity
        if guessed and lo < neighbour < hi and neighbour not in known:
            size, guessed = neighbour, False
            continue
        guess = _secant_guess(known, budget, lo, hi, max_val)
        if width is not None and hi <= max_val and 2 * (hi - lo) > width:
            guess = (lo + hi) // 2  # the line is bending: bisect
        width = hi - lo if hi <= max_val else None
        if guess in known or not lo < guess < hi:
            break
        size, guessed = guess, len(known) >= 2
    fitting = [s for s, m in known.items() if m <= budget]
    return max(fitting) if fitting else None


def predict_largest_by_projection(least_at: Callable[[int], tuple[int, Callable[[int], int]]],
                                  budget: int, init_val: int, max_val: int, granularity: int = 1,
                                  max_evaluations: int = 10) -> int | None:
    """The largest size whose smallest feasible budget is within ``budget``, where each
    evaluation also projects its plan: ``least_at(size)`` gives the smallest budget at
    ``size`` and ``peak(other)``, the peak (with its margin) of the plan that has it, run
    at another size. The largest size where that peak stays within ``budget`` (bisection
    on the cheap projection) is evaluated next, and the size ``granularity`` past the
    largest that fits: where that one does not fit, the answer is known. A plan made for a
    smaller batch is close to the best one for a larger (the same stages keep the same
    values), so this takes two to four evaluations. Where a projected size does not fit by
    the smallest budget itself (a solver whose own model is looser than the plan's
    simulation), the answer lies between it and the largest known to fit, found by
    :func:`predict_largest_by_min_budget`'s lines. When ``init_val`` does not fit, that
    function looks below it. None when nothing fits."""
    check_search_args(init_val, max_val, granularity)
    known: dict[int, int] = {}

    def evaluate(size: int) -> Callable[[int], int]:
        known[size], peak = least_at(size)
        return peak

    peak = evaluate(init_val)
    if known[init_val] > budget:
        return predict_largest_by_min_budget(
            lambda size: known[size] if size in known else least_at(size)[0], budget, init_val,
            max_val, granularity, max_evaluations - 1)
    fit = init_val
    # How much the last plan's projection overstated the next size's smallest budget, per
    # size: a plan made for a smaller batch keeps what a larger one could recompute, so its
    # projection grows a little faster than the best plan's, and the next plan's will too.
    # Taken off the projections, it saves walking up one size per evaluation.
    overstated = 0.0

    def projected(size: int) -> float:
        return math.floor(peak(size) - overstated * (size - fit))

    while len(known) < max_evaluations:
        lo, hi = fit, max_val + 1  # the latest plan fits at ``fit``: bisect above it
        if projected(max_val) <= budget:
            lo = max_val
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if projected(mid) <= budget:
                lo = mid
            else:
                hi = mid
        if lo == fit:  # the plan stops fitting here: is the size past it out of reach?
            lo = fit + granularity
            if lo > max_val or lo in known:
                break
        if lo in known:
            break
        candidate = evaluate(lo)
        if known[lo] > budget:
            break
        overstated = max((peak(lo) - known[lo]) / (lo - fit), 0.0)
        fit, peak = lo, candidate
    failing = [s for s, m in known.items() if m > budget and s > fit]
    if not failing or min(failing) - fit <= granularity or len(known) >= max_evaluations:
        return fit
    # The projection overshot the solver's reach: its lines between the two known sizes.
    return predict_largest_by_min_budget(
        lambda size: known[size] if size in known else least_at(size)[0], budget, fit,
        min(failing) - 1, granularity, max_evaluations - len(known) + 1)


def _secant_guess(known: dict[int, int], budget: int, lo: int, hi: int, max_val: int) -> int:
    """Where the line through the two known sizes nearest the crossing meets ``budget``
    (twice or half the one size known), strictly inside the bracket ``(lo, hi)``."""
    sizes = sorted(known)
    if lo and hi <= max_val:
        a, b = lo, hi
    elif len(sizes) >= 2:
        a, b = (sizes[-2], sizes[-1]) if lo else (sizes[0], sizes[1])
    else:
        return min(2 * lo, max_val) if lo else max(1, hi // 2)
    slope = (known[b] - known[a]) / (b - a)
    guess = max_val if slope <= 0 else int(a + (budget - known[a]) / slope)
    return min(max(guess, lo + 1), hi - 1, max_val)


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
) -> SearchResult:
    """Find the largest batch size ``trial_fn`` calls feasible (exact within ``granularity``).

    ``storage`` is any Optuna storage (URL such as ``sqlite:///path.db`` or
    ``postgresql://...``); None keeps the study in memory. A study of that name already in
    the storage is continued. ``max_trials`` bounds the trials of this call. ``hint``: the
    size predicted to be the largest that fits, or several, most hopeful first; each is
    enqueued as a trial (:func:`next_batch_size` says what follows them), and one the
    trials before it have already decided is pruned, not measured.

    A URL gets a storage with Optuna's heartbeat: a trial a killed search left running is
    failed once its heartbeat is older than the grace period (this search waits that long
    for one it finds still running) and retried (``RetryHeartbeatStaleTrialCallback``),
    with one warning. A storage object is used as given.
    """
    check_search_args(init_val, max_val, granularity)
    if not isinstance(max_trials, int) or max_trials < 1:
        raise ValueError(f"max_trials={max_trials!r} must be an int >= 1")
    with _optuna_logs_quiet():  # its INFO lines: a study created, a trial finished or pruned
        sampler = BisectionSampler(init_val, max_val, granularity)
        stale = _StaleTrials(label)
        study = _load_study(storage, study_name, sampler, stale)
        if isinstance(storage, str):  # the storage with a heartbeat
            stale.fail(study)
        guesses = [] if hint is None else [hint] if isinstance(hint, int) else list(hint)
        for guess in guesses:
            size = min(max(int(guess), 1), max_val)
            study.enqueue_trial({PARAM: size}, user_attrs={PREDICTED: size}, skip_if_exists=True)
        trials_run = 0

        def objective(trial: optuna.Trial) -> tuple[float, float]:
            nonlocal trials_run
            batch_size = trial.suggest_int(PARAM, 1, max_val)
            if decided(study, batch_size):  # an enqueued prediction the trials before it decided
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

        bar = _progress(progress_bar, label)
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
        finally:
            if bar is not None:
                bar.close()
        stale.warn(study)  # trials another search left running meanwhile (Optuna retried them)
    records = finished_records(study)
    br = bracket([(r.batch_size, r.feasible) for r in records])
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
        pareto=pareto_front(study, records),
    )


class TrialFailedOnRank(RuntimeError):
    """A trial raised on some rank (every rank raises it together, from the same gather)."""


# What rank zero broadcasts to the other ranks while it searches (:func:`run_search_across_ranks`).


@dataclass(frozen=True)
class TrialAt:
    """Run the trial at ``batch_size`` (every rank runs it: FSDP's collectives need all)."""

    batch_size: int


@dataclass(frozen=True)
class SearchDone:
    """The search ended with ``result``, which every rank returns."""

    result: SearchResult


@dataclass(frozen=True)
class SearchStopped:
    """Rank zero's search raised ``error`` (``"TypeName: message"``); every rank stops."""

    error: str


def combine_trials(results: Sequence[TrialResult]) -> TrialResult:
    """One verdict for a trial every rank ran: it fits only when it fits on every rank, its
    peak is the worst rank's, its time the slowest rank's (the step waits for it)."""
    first = results[0]
    peaks = [r.peak_bytes for r in results if r.peak_bytes is not None]
    seconds = [r.seconds for r in results if r.seconds is not None]
    reasons = [f"rank {rank}: {r.reason}" for rank, r in enumerate(results) if r.reason]
    return TrialResult(
        feasible=all(r.feasible for r in results), peak_bytes=max(peaks) if peaks else None,
        seconds=max(seconds) if seconds else None, reason="; ".join(reasons[:1]),
        predicted_extra_seconds=first.predicted_extra_seconds,
        predicted_peak_bytes=first.predicted_peak_bytes, solver=first.solver,
    )


def _trial_on_every_rank(trial_fn: TrialFn, batch_size: int, ranks: Ranks) -> TrialResult:
    """The trial on this rank, then every rank's verdict combined (a collective). A rank that
    ran out of memory may have left the others inside one of the step's collectives (FSDP's
    gathers, DDP's reductions, a SyncBatchNorm): they leave it only when it times out, and
    then every rank stops with one :class:`~lightning_remat.errors.SearchStoppedError`
    (docs/design.md section 7, "Batch-size search")."""
    try:
        local, error = run_trial_safely(trial_fn, batch_size), ""
    except Exception as exc:  # shared below, so that no rank waits for one that stopped
        local, error = TrialResult(False), f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    try:
        gathered = ranks.gather((local, error))
    except Exception as exc:
        if not local.out_of_memory:
            raise
        # The others never reached the verdict (a timed-out NCCL collective ends its process).
        raise SearchStoppedError(_stopped_message(batch_size, {ranks.rank: local.reason},
                                                  {-1: f"{type(exc).__name__}: {exc}"}),
                                 batch_size, [ranks.rank]) from exc
    out_of_memory = {rank: r.reason for rank, (r, _) in enumerate(gathered) if r.out_of_memory}
    failed = {rank: e for rank, (_, e) in enumerate(gathered) if e}
    if out_of_memory and failed:
        raise SearchStoppedError(_stopped_message(batch_size, out_of_memory, failed), batch_size,
                                 sorted(out_of_memory))
    if failed:
        raise TrialFailedOnRank(f"lightning_remat: the trial at batch size {batch_size} failed on "
                                + "; ".join(f"rank {rank}: {e}" for rank, e in failed.items()))
    return combine_trials([r for r, _ in gathered])


def _stopped_message(batch_size: int, out_of_memory: dict[int, str], failed: dict[int, str]) -> str:
    oom = ", ".join(f"rank {rank}" for rank in sorted(out_of_memory))
    others = "; ".join(f"rank {rank}: {e}" if rank >= 0 else e for rank, e in failed.items())
    return (
        f"lightning_remat: the batch-size trial at batch size {batch_size} ran out of memory on "
        f"{oom} ({next(iter(out_of_memory.values()))}) while the other ranks waited in a "
        f"collective of the step, which failed ({others[:300]}). After a failed collective the "
        "process group cannot be trusted, so the search stops on every rank and the batch size "
        f"is left as it was. Keep the trials within memory and search again: pass "
        f"max_val below {batch_size}, or a memory_budget in bytes below the device memory (a "
        "trial over it is then judged by its measured peak on every rank, without running out)")


def run_search_across_ranks(trial_fn: TrialFn, ranks: Ranks, **search_args: Any) -> SearchResult:
    """:func:`run_search` for data-parallel ranks (DDP, FSDP): one study, on rank zero (the
    only rank that opens the storage); rank zero broadcasts each size it tries, every rank
    runs the trial (FSDP's collectives need all of them), and the trial fits only when it
    fits on every rank (:func:`combine_trials`: the worst peak over ranks). Every rank
    returns rank zero's result. ``search_args``: :func:`run_search`'s keywords."""
    if ranks.rank != 0:
        while True:
            message: TrialAt | SearchDone | SearchStopped = ranks.broadcast(None, 0)
            if isinstance(message, TrialAt):
                _trial_on_every_rank(trial_fn, message.batch_size, ranks)
            elif isinstance(message, SearchDone):
                return message.result
            else:
                raise RuntimeError(f"lightning_remat: rank 0's batch-size search stopped "
                                   f"({message.error}); every rank stops with it")

    def lead(batch_size: int) -> TrialResult:
        ranks.broadcast(TrialAt(batch_size), 0)
        return _trial_on_every_rank(trial_fn, batch_size, ranks)

    try:
        result = run_search(lead, **search_args)
    except (TrialFailedOnRank, SearchStoppedError):
        raise  # every rank raised it
    except BaseException as exc:
        ranks.broadcast(SearchStopped(f"{type(exc).__name__}: {exc}"), 0)
        raise
    ranks.broadcast(SearchDone(result), 0)
    return result


def sqlite_path(storage: Any) -> Path | None:
    """The file of an Optuna SQLite storage URL (``sqlite:///path``), else None."""
    if isinstance(storage, str) and storage.startswith("sqlite:///"):
        path = storage.removeprefix("sqlite:///").split("?", 1)[0]
        return None if path in ("", ":memory:") else Path(path)
    return None


def decided(study: Study, size: int) -> bool:
    """Whether the finished trials decide ``size``: measured, or outside the bracket."""
    records = finished_records(study)
    br = bracket([(r.batch_size, r.feasible) for r in records])
    return (size <= br.largest_feasible or any(r.batch_size == size for r in records)
            or (br.smallest_infeasible is not None and size >= br.smallest_infeasible))


HEARTBEAT_SECONDS = 1
"""How often a running trial of a storage opened from a URL records that it is alive; one
not heard from for twice that long (Optuna's default grace period) is stale."""


class _StaleTrials:
    """Trials a killed search left running: Optuna fails them once their heartbeat is stale
    (``fail_stale_trials``) and this callback retries each
    (``RetryHeartbeatStaleTrialCallback``), keeping its size for one warning."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.sizes: list[Any] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self._retry = optuna.storages.RetryHeartbeatStaleTrialCallback()

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        self.sizes.append(trial.params.get(PARAM))
        self._retry(study, trial)

    def fail(self, study: Study) -> None:
        """Fail and retry the stale trials, with one warning. A trial whose heartbeat is
        still fresh may be a search killed a moment ago: it is waited for until the grace
        period tells (a search running the same study elsewhere keeps its trials alive,
        and they are left to it)."""
        # Optuna's grace period, plus the beat before the kill and SQLite's whole seconds.
        wait_until = time.monotonic() + 3 * HEARTBEAT_SECONDS + 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
            while (study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   and time.monotonic() < wait_until):
                time.sleep(0.25)
                optuna.storages.fail_stale_trials(study)
        self.warn(study)

    def warn(self, study: Study) -> None:
        """One warning for the trials failed and retried since the last one."""
        if self.sizes:
            warn_caller(
                f"lightning-remat batch-size search ({self.label}): {len(self.sizes)} trial(s) of study "
                f"{study.study_name!r} were left running by an interrupted search (batch sizes "
                f"{self.sizes}); marked them failed, their sizes run again")
            self.sizes.clear()


def _load_study(storage: str | optuna.storages.BaseStorage | None, study_name: str,
                sampler: BaseSampler, stale: _StaleTrials) -> Study:
    """Create or load the study; an SQLite file that cannot be read is moved aside with one
    warning and the search starts over in a new one. One that cannot be opened or written (a
    read-only file or folder, a folder path under a file) warns once and the search runs in
    memory, its trials not stored."""
    def load(storage: str | optuna.storages.BaseStorage | None = storage) -> Study:
        storage_object = storage
        if isinstance(storage, str):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage_object = optuna.storages.RDBStorage(
                    storage, heartbeat_interval=HEARTBEAT_SECONDS, heartbeat_stale_trial_callback=stale)
        return optuna.create_study(storage=storage_object, study_name=study_name, sampler=sampler,
                                   directions=["maximize", "maximize"], load_if_exists=True)

    path = sqlite_path(storage)
    if path is None:
        return load()
    problem = sqlite_problem(path)
    if problem is None:
        try:
            return load()
        except Exception as exc:  # SQLAlchemy's and Optuna's errors for a foreign schema
            import sqlalchemy.exc

            if not isinstance(exc, (sqlalchemy.exc.SQLAlchemyError, RuntimeError)):
                raise
            problem = str(exc).splitlines()[0]
            if not path.exists() and not is_access_problem(problem):
                raise
    if not is_access_problem(problem):
        try:
            move_aside(path, problem, "batch-size study storage")
            return load()
        except OSError as exc:
            problem = f"{problem}; then {exc}"
    warn_caller(f"lightning-remat: batch-size study storage {path} cannot be used ({problem}); the "
                "search goes on without it: its trials are kept in memory and not stored")
    return load(None)


def pareto_front(study: Study, records: Sequence[TrialRecord]) -> list[TrialRecord]:
    """Feasible trials not dominated in (batch size, samples/s), by increasing batch size:
    Optuna's ``study.best_trials`` (the constraint ``within_budget`` leaves the infeasible
    ones out), less trials without a measured time (their samples/s of 0 dominates none)."""
    by_number = {r.number: r for r in records}
    front = [by_number[t.number] for t in study.best_trials if t.number in by_number]
    return sorted((r for r in front if r.samples_per_second is not None), key=lambda r: r.batch_size)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


@contextlib.contextmanager
def _optuna_logs_quiet() -> Iterator[None]:
    """Optuna's log level at WARNING inside, as it was outside."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _progress(enabled: bool, label: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(desc=f"batch size ({label})", unit="trial", leave=False, dynamic_ncols=True)


def default_storage(root_dir: str | Path) -> str:
    """``sqlite:///<root_dir>/lightning_remat_cache/batch_size.db`` (the folder is created)."""
    folder = default_cache_dir(Path(root_dir).resolve())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # the search warns that it cannot use the file, and runs in memory
    return f"sqlite:///{folder / 'batch_size.db'}"


def study_name_for(model: nn.Module, device: torch.device, budget_bytes: int | None, solver: str,
                   sample_shape: str = "", precision: str = "", ranks: int = 1) -> str:
    """``<ModelClass>#<fingerprint>|<device>|<budget bytes>|<solver>[|<precision>][|<ranks>
    ranks][|<per-sample input shapes>]``: one study per setting, so a resumed search only
    reuses trials that measured the same thing (a changed model, its attention
    implementation say, starts a study of its own; :func:`module_fingerprint`)."""
    parts = [f"{type(model).__name__}#{module_fingerprint(model)}", device_name(torch.device(device)),
             f"{budget_bytes}B", solver]
    if precision:
        parts.append(str(precision))
    if ranks > 1:
        parts.append(f"{ranks} ranks")
    if sample_shape:
        parts.append(sample_shape)
    return "|".join(parts)


def module_fingerprint(model: nn.Module) -> str:
    """A short hash of what a batch-size search's answer depends on in ``model``: its
    modules' classes, its parameters' and buffers' names, shapes, dtypes and whether they
    train, and the settings of each ``config`` it holds (a Hugging Face config's JSON and
    attention implementation)."""
    digest = hashlib.sha1()
    configs: set[int] = set()
    for name, sub in model.named_modules():
        digest.update(f"{name}:{type(sub).__module__}.{type(sub).__qualname__};".encode())
        config = getattr(sub, "config", None)
        if config is not None and id(config) not in configs:
            configs.add(id(config))
            to_json = getattr(config, "to_json_string", None)
            try:
                text = to_json(use_diff=False) if callable(to_json) else repr(vars(config))
            except Exception:  # a config we cannot read: its type alone
                text = type(config).__qualname__
            digest.update(f"{text};{getattr(config, '_attn_implementation', None)};".encode())
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    for name, b in model.named_buffers():
        digest.update(f"{name}:{tuple(b.shape)}:{b.dtype};".encode())
    return digest.hexdigest()[:12]
