"""Plans stored before this run: a checkpoint's (by input key) and the plan cache's (by
:class:`~lightning_remat.cache.PlanBasis`), each used only when what decided it is what this
call would decide by, and simulated again on its own graph against this run's budget before
it is trusted (docs/design.md section 3); where none is used, one warning says what changed."""

from __future__ import annotations

import dataclasses

import torch

from lightning_remat.cache import PlanBasis, StoredPlan, describe_change, resimulated
from lightning_remat.errors import warn_caller
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan
from lightning_remat.solvers.policy import in_forward_order, plain_peak_bytes

__all__ = ["StoredPlans"]


class StoredPlans:
    """The store lookups of :class:`~lightning_remat.planner.Planner`, which holds the
    stores (``restored``, ``cache``) and the budget they are checked against."""

    def _trusted(self, graph: Graph, plan: Plan, source: str, device: torch.device,
                 per_submodule: bool) -> tuple[Graph, Plan] | None:
        """A stored plan re-simulated on its graph (:func:`~lightning_remat.cache.resimulated`)
        against this run's budget, with its prediction recomputed, and cut at the forward's
        order where it leaves it and a plan that keeps it fits
        (:func:`~lightning_remat.solvers.policy.in_forward_order`); None, after one warning,
        when it does not cover its graph or is over the budget (the caller plans afresh, and
        a fresh plan replaces it in the cache)."""
        budget = self._budget_read = self._budget(graph, device)
        excess = int(graph.meta.measured_excess_bytes or 0)
        plain_fits = (budget is not None and self.settings.solver == "auto" and bool(graph.meta.plain_peak_bytes)
                      and plain_peak_bytes(graph) + excess <= budget)
        try:
            trusted = resimulated(graph, plan, budget, whole_stages=per_submodule, plain_fits=plain_fits)
            if budget is not None and not per_submodule:
                # Stored before the policy kept the forward's order where the budget allows.
                trusted = in_forward_order(graph, trusted, budget)
            return graph, trusted
        except (ValueError, KeyError) as exc:
            self._budget_read = None
            warn_caller(f"lightning-remat: the {source}'s plan for this input is not used: {exc}; "
                        "planning again")
            return None

    def _restored_for(self, key_text: str, basis: PlanBasis) -> tuple[StoredPlan | None, bool]:
        """The checkpoint's plan for this key and ``basis``, and whether a warning said why
        there is none (what differs from the nearest plan: one for the same key, or any on
        this run's first plan)."""
        stored = self.restored.get(key_text)
        if stored is not None and stored.basis == basis:
            return stored, False
        if stored is None and (not self.restored or self.planned):
            return None, False
        candidates = [stored] if stored is not None else list(self.restored.values())
        known = [c.basis for c in candidates if c.basis is not None]
        if known:
            return None, self._say_why_not(basis, known, "checkpoint", same_inputs=False)
        warn_caller(describe_change(None, basis, "checkpoint"))
        return None, True

    def _say_why_not(self, basis: PlanBasis, others: list[PlanBasis], source: str,
                     same_inputs: bool = True) -> bool:
        """Warn why the nearest of ``others`` (the same graph and, with ``same_inputs``, the
        same inputs) is not reused for ``basis``; whether it warned. Only the rank that plans
        a key gets here, so the line is written once."""
        near = [b for b in others if b.graph_hash == basis.graph_hash
                and (not same_inputs or b.input_key == basis.input_key)]
        if not near and not same_inputs:
            near = others
        if not near:
            return False
        names = [f.name for f in dataclasses.fields(PlanBasis)]
        nearest = min(near, key=lambda b: sum(getattr(b, n) != getattr(basis, n) for n in names))
        warn_caller(describe_change(nearest, basis, source))
        return True
