"""Where a batch-size search starts: the largest size predicted to fit, from the planner's
smallest budgets at a few sizes, found by the same doubling and bisection the search runs
(:mod:`.search`), on solves instead of measured trials."""

from __future__ import annotations

import math
from collections.abc import Callable

from lightning_remat.tuning.search import bracket, check_search_args, next_batch_size


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
