"""Errors a user can act on: each message says what was wrong and what to do; warnings
shown at the user's own line (:func:`warn_caller`)."""

from __future__ import annotations

import os
import sys
import warnings

from lightning_remat.budget import format_bytes, with_room


class RematError(Exception):
    """Base class of the errors lightning-remat raises on purpose."""


class RematInfeasibleError(RematError):
    """No plan fits the budget. ``min_budget_bytes`` is the smallest budget any tried
    method reaches (None when it is not known)."""

    def __init__(self, budget_bytes: int, min_budget_bytes: int | None, tried: str = "",
                 measured_peak_bytes: int | None = None, *, cause: str = "",
                 profiled_least_bytes: int | None = None) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = None if min_budget_bytes is None else int(min_budget_bytes)
        self.tried = tried
        self.cause = cause
        self.profiled_least_bytes = profiled_least_bytes
        """Where the budget named holds room for another profile (:meth:`with_room`): the
        smallest budget this profile's graph is planned at."""
        """Why the smallest budget is high, where it is known (a coarse capture)."""
        self.measured_peak_bytes = None if measured_peak_bytes is None else int(measured_peak_bytes)
        """The training step's measured peak, where the refusal comes from a step measured
        over the budget (planned again and still over, or with no plan left that fits)."""
        if self.measured_peak_bytes is not None:
            message = (f"the first training step under the plan measured "
                       f"{format_bytes(self.measured_peak_bytes)} ({self.measured_peak_bytes} bytes), "
                       f"over the budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes), and "
                       "planned again with the model's margin raised by what it measured over, no plan "
                       "holds the budget")
        else:
            message = f"no plan fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes)"
        if tried:
            message += f" with {tried}"
        if self.min_budget_bytes is not None:
            room = ("" if profiled_least_bytes is None else
                    f": this profile's least, {profiled_least_bytes}, and room for the next profile's")
            message += (
                f"; the smallest feasible budget is {format_bytes(self.min_budget_bytes)} "
                f"({self.min_budget_bytes} bytes{room}): raise memory_budget to at least that,"
                " or lower the batch size"
            )
        if cause:
            message += f". {cause}"
        self._message = message
        super().__init__(message)

    def because(self, cause: str) -> RematInfeasibleError:
        """The same refusal with ``cause`` said after it."""
        return RematInfeasibleError(self.budget_bytes, self.min_budget_bytes, self.tried,
                                    self.measured_peak_bytes, cause=cause,
                                    profiled_least_bytes=self.profiled_least_bytes)

    def with_room(self) -> RematInfeasibleError:
        """The same refusal naming a budget a little above the smallest one
        (:func:`~lightning_remat.budget.with_room`): given again, ``remat()`` profiles
        again, and that profile's smallest budget can be higher by bytes."""
        if self.min_budget_bytes is None or self.profiled_least_bytes is not None \
                or self.args != (self._message,):  # named already, or told in words of its own
            return self
        return RematInfeasibleError(self.budget_bytes, with_room(self.min_budget_bytes),
                                    self.tried, self.measured_peak_bytes, cause=self.cause,
                                    profiled_least_bytes=self.min_budget_bytes)


class SolverDeclinedError(RematInfeasibleError):
    """The solver does not plan a graph like this one at any budget (the exact Kusumoto DP on
    a graph with more lower sets than it enumerates): the message says why and which solver
    to use instead. ``min_budget_bytes`` is None: no budget makes this solver plan it."""

    def __init__(self, budget_bytes: int | None, solver: str, reason: str, instead: str) -> None:
        self.budget_bytes = int(budget_bytes or 0)
        self.min_budget_bytes = None
        self.tried = solver
        self.reason = reason
        self.instead = instead
        RematError.__init__(self, f"solver {solver!r} declines this graph: {reason}; {instead}")

    def for_solver(self, budget_bytes: int | None, solver: str) -> SolverDeclinedError:
        """The same refusal, naming the solver the user chose and the budget asked for."""
        return SolverDeclinedError(budget_bytes, solver, self.reason, self.instead)


class TraceError(RematError):
    """Neither torch.fx nor checkpointing its submodules in place can describe the module."""


class SideEffectError(TraceError):
    """The forward changes module state (a buffer, an attribute) in a way the captured
    graph cannot repeat once per step; the message names the module and the line."""


_FRAMEWORKS = ("torch", "lightning", "pytorch_lightning", "lightning_fabric")
"""Packages whose frames lie between the user's code and this one (a module's ``__call__``,
Lightning's loops): a warning meant for the user skips them too."""


def _skipped_prefixes() -> tuple[str, ...]:
    # The frameworks loaded now (looked up, never imported: the engine runs without Lightning).
    packages = [sys.modules[__name__.partition(".")[0]]]
    packages += [sys.modules[name] for name in _FRAMEWORKS if name in sys.modules]
    files = [getattr(package, "__file__", None) for package in packages]
    return tuple(os.path.dirname(file) + os.sep for file in files if file)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn at the user's code: the first frame outside this package and the frameworks that
    call into it (torch, Lightning), however deep the warning is raised, so that the line
    shown is the user's and warning filters by module match the user's module."""
    prefixes = _skipped_prefixes()
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, stacklevel=2, skip_file_prefixes=prefixes)
        return
    # Python < 3.12 has no skip_file_prefixes: count the frames it would skip.
    frame, stacklevel = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(message, category, stacklevel=stacklevel)


class SearchStoppedError(RematError):
    """A batch-size trial ran out of memory on some ranks while others were left inside one
    of the step's collectives, which timed out: the process group cannot be trusted after
    that, so the search stops on every rank with this error (the batch size not written).
    ``ranks`` ran out of memory at ``batch_size``."""

    def __init__(self, message: str, batch_size: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.batch_size = batch_size
        self.ranks = ranks
