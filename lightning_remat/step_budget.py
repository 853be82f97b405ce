"""One budget for a training step that calls several planned modules in turn (an encoder
and a head, say), rather than one budget each (docs/design.md section 4.7).

The modules' plans share the step's budget: for a fraction of the plain peak (``"50%"``)
it is that fraction of their plain peaks together, for bytes the bytes. A module is planned
when it is first called, so each is granted what the step's budget leaves beside the plans
of those planned before it (the first, its own share). A module that cannot meet its grant
is planned at the least it needs, and the modules planned before it are planned again
lower, each no lower than its own least, so that the plans together stay within the step's
budget; where the least of each together exceed it, planning is refused with an error
that names each module, the least it needs, and the budget to give. The step's peak is at
most the sum of the modules' peaks (each module's step holds no more than its own peak
while the others' saved values wait), so the sum of the plans' guaranteed peaks bounds it.

The modules planned before the one that needed more ran the step in which it was planned
under their earlier plans: the bound holds from the next step on. In the first training
step, the first module planned may take the least it needs beyond its own share (the
modules after it, not known yet, may leave it that); when the step ends the plans are held
to the step's budget together, or refused (one module alone: as it would be alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning_remat.budget import Budget, format_bytes, with_room
from lightning_remat.errors import RematInfeasibleError
from lightning_remat.graph.ir import Graph

__all__ = ["StepBudget", "named_refusal", "naming"]

Planner = Any
"""A :class:`~lightning_remat.planner.Planner` (which imports this module)."""


def naming(refused: RematInfeasibleError, name: str) -> RematInfeasibleError:
    """``refused`` with the module it refuses named (``name`` in the LightningModule; ``""``
    the LightningModule), unless it names the step's modules already."""
    if refused.args and "planned modules" not in str(refused.args[0]):
        label = f"module {name!r}" if name else "the LightningModule"
        refused.args = (f"planning {label} of the training step: {refused.args[0]}", *refused.args[1:])
    return refused


def named_refusal(planner: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``planner``'s call, a refusal to plan it naming the module it plans (:func:`naming`)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return planner(*args, **kwargs)
        except RematInfeasibleError as refused:
            raise naming(refused, name) from None

    return call


class StepBudget:
    """The budget the planned modules of one training step share. ``memory_budget``: as
    the planners' settings give it (None: no limit, nothing shared)."""

    def __init__(self, memory_budget: int | float | str | None) -> None:
        self.memory_budget = memory_budget
        self.relative = Budget.of(memory_budget).relative
        self.members: dict[str, Planner] = {}
        """Each planned module's planner, by name, in the order the step first called them."""
        self.own: dict[str, int] = {}
        """Each module's own budget for its latest input (its share of a fraction)."""
        self.plain: dict[str, int] = {}
        """Each module's plain peak for its latest input."""
        self.detecting = False
        """Whether the first training step runs: the step's modules are not all known yet."""
        self.deferred: dict[str, RematInfeasibleError] = {}
        """Modules of the first step planned at their least, over their grant, before any
        other was planned: held to the step's budget when the step ends (:meth:`check`)."""

    def add(self, name: str, planner: Planner) -> None:
        """Share the step's budget with ``planner``'s module, named ``name``."""
        self.members[name] = planner
        planner.step_budget = self

    def name_of(self, planner: Planner) -> str:
        return next(n for n, p in self.members.items() if p is planner)

    def total(self) -> int:
        """The step's budget: the modules' own shares together for a fraction, the bytes
        given otherwise."""
        return sum(self.own.values()) if self.relative else max(self.own.values())

    def used(self, name: str) -> int:
        """What the plan ``name`` runs now may take: its guaranteed peak, or the budget it
        was accepted for where that is less (the plain plan, taken where the plain step
        measured within the budget); 0 before a plan."""
        entry = self.members[name].last
        if entry is None:
            return 0
        taken = int(entry.plan.guaranteed_peak_bytes)
        return taken if entry.budget_bytes is None else min(taken, int(entry.budget_bytes))

    def _others(self, name: str) -> list[str]:
        return [n for n in self.members if n != name and self.members[n].last is not None]

    def grant(self, planner: Planner, graph: Graph, own: int, plain_peak: int) -> int:
        """The budget ``planner`` plans ``graph`` at: what the step's budget leaves beside the
        other modules' plans (``own``: its own share, ``plain_peak``: its plain peak)."""
        name = self.name_of(planner)
        self.own[name], self.plain[name] = int(own), int(plain_peak)
        others = self._others(name)
        if not others:
            return int(own)
        return max(self.total() - sum(self.used(n) for n in others), 0)

    def over(self, planner: Planner, refused: RematInfeasibleError) -> int:
        """``planner``'s module cannot meet its grant: the budget it plans at instead, all
        the step's budget leaves once the modules planned before it are planned again
        lower (no lower than each one's least). Re-raises ``refused`` for a module planned
        alone; raises the step's refusal where the least of each together exceed the
        step's budget."""
        name = self.name_of(planner)
        others = self._others(name)
        least_here = refused.min_budget_bytes
        if least_here is None:
            raise refused
        if not others:
            if not self.detecting:
                raise refused
            # The first module of the first step: the modules after it may leave it more.
            self.deferred[name] = refused
            return int(least_here)
        total = self.total()
        least = {n: self.members[n].least_budget(self.members[n].last) for n in others}
        if any(v is None for v in least.values()) or least_here + sum(least.values()) > total:  # type: ignore[arg-type]
            raise self._refusal({**least, name: least_here}, total) from None
        self._lower(sorted(others, key=self.used, reverse=True), least,
                    least_here + sum(self.used(n) for n in others) - total)
        return total - sum(self.used(n) for n in others)

    def _lower(self, order: list[str], least: dict[str, int | None], need: int) -> None:
        """Plan the modules named in ``order`` again lower, in that order, each no lower
        than its least, until ``need`` bytes are freed for the step."""
        for other in order:
            if need <= 0:
                break
            before = self.used(other)
            target = max(int(least[other] or 0), before - need)
            if target < before:
                self.members[other].plan_within(self.members[other].last, target)
                need -= before - self.used(other)

    def check(self) -> None:
        """At the end of the first training step: a module planned at its least before the
        others were known (:attr:`deferred`) is within the step's budget once they are, or
        the modules planned before the last are planned again lower (as in :meth:`over`);
        or the step is refused (one module alone: its own refusal)."""
        deferred, self.deferred, self.detecting = self.deferred, {}, False
        if not deferred:
            return
        total = self.total()
        names = [n for n in self.members if self.members[n].last is not None]
        if sum(self.used(n) for n in names) <= total:
            return
        if len(names) == 1:
            raise naming(deferred[names[0]].with_room(), names[0]) if names[0] in deferred \
                else next(iter(deferred.values())).with_room()
        least = {n: (deferred[n].min_budget_bytes if n in deferred else
                     self.members[n].least_budget(self.members[n].last)) for n in names}
        if any(v is None for v in least.values()) or sum(int(v or 0) for v in least.values()) > total:
            raise self._refusal(least, total)
        self._lower(sorted(names, key=lambda n: self.used(n) - int(least[n] or 0), reverse=True), least,
                    sum(self.used(n) for n in names) - total)

    def _refusal(self, least: dict[str, int | None], total: int) -> RematInfeasibleError:
        needed = with_room(sum(int(v or 0) for v in least.values()))  # met by new profiles
        each = ", ".join(f"{n or 'the LightningModule'} at least {format_bytes(int(v or 0))}"
                         for n, v in least.items())
        if self.relative:
            plain = sum(self.plain.get(n, 0) for n in least)
            percent = math.ceil(1000 * needed / plain) / 10 if plain else 100.0
            advice = f"memory_budget='{percent:g}%' (of their plain peaks together, {format_bytes(needed)})"
            given = f"{self.memory_budget!r} of their plain peaks together, {format_bytes(total)}"
        else:
            advice = f"memory_budget={needed} ({format_bytes(needed)})"
            given = format_bytes(total)
        error = RematInfeasibleError(total, needed)
        error.args = (
            f"the training step calls {len(least)} planned modules in turn, which share one budget "
            f"of {given}; no plans fit it together: {each}. Give {advice} or more, or lower the "
            "batch size",)
        return error
