"""The batch-size search across data-parallel ranks: one study on rank zero, every rank runs
each trial, and a size fits only where it fits on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_remat.errors import SearchStoppedError
from lightning_remat.messages import Ranks
from lightning_remat.tuning.search import (
    SearchResult,
    TrialFn,
    TrialResult,
    run_search,
    run_trial_safely,
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
