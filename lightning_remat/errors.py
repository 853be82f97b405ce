"""Errors a user can act on: each message says what was wrong and what to do."""

from __future__ import annotations

from lightning_remat.budget import format_bytes


class RematError(Exception):
    """Base class of the errors lightning-remat raises on purpose."""


class RematInfeasibleError(RematError):
    """No plan fits the budget. ``min_budget_bytes`` is the smallest budget any tried
    method reaches (None when it is not known)."""

    def __init__(self, budget_bytes: int, min_budget_bytes: int | None, tried: str = "") -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_budget_bytes = None if min_budget_bytes is None else int(min_budget_bytes)
        self.tried = tried
        message = f"no plan fits a budget of {format_bytes(budget_bytes)} ({budget_bytes} bytes)"
        if tried:
            message += f" with {tried}"
        if self.min_budget_bytes is not None:
            message += (
                f"; the smallest feasible budget is {format_bytes(self.min_budget_bytes)} "
                f"({self.min_budget_bytes} bytes): raise memory_budget to at least that,"
                " or lower the batch size"
            )
        super().__init__(message)


class TraceError(RematError):
    """Neither torch.fx nor checkpointing its submodules in place can describe the module."""
