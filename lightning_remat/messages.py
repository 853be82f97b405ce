"""What data-parallel ranks say to each other while they plan, and the collectives they say
it with.

Under DDP every rank agrees, at each training call, whether some rank meets an input key it
has no plan for (:class:`~lightning_remat.planner.Planner`). Each new key has an owner, the
lowest rank holding it, and its planning is one exchange (:class:`Exchange`): the owner
broadcasts, the other ranks receive, in the same order on every rank. What the owner
broadcasts is one of the messages below, each a frozen dataclass:

- :class:`SharedCall`: sharded ranks (torch FSDP) trace and profile the owner's call
  together, since FSDP gathers parameters inside each unit's call; the owner sends it;
- :class:`ProfileTogether`: the owner holds no stored plan and starts profiling; sharded
  ranks join it, to run their share of FSDP's collectives;
- :class:`SharedPlan`: the graph and plan the owner made, which every rank applies;
- :class:`PlanningFailed`: the error that stopped the owner, which every rank raises (the
  other ranks wait in the broadcast and must not hang).

The batch-size search across ranks sends its own (rank zero's trials and result:
:class:`~lightning_remat.tuning.ranks.TrialAt` and the rest, beside the search they carry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from lightning_remat.errors import RematInfeasibleError
from lightning_remat.graph.ir import Graph
from lightning_remat.inputs import InputKey
from lightning_remat.solvers.plan import Plan

__all__ = [
    "DistributedRanks", "Exchange", "agreement_group", "Message", "PlanningFailed", "ProfileTogether", "Ranks",
    "SharedCall", "SharedPlan", "world_size",
]


def world_size() -> int:
    """The number of processes in torch.distributed's default group (1 when there is none)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Ranks(Protocol):
    """The collectives the planner needs from a group of data-parallel processes. Every
    method is a collective: every rank calls it, in the same order."""

    rank: int

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank."""
        ...

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        ...


class DistributedRanks:
    """:class:`Ranks` over ``torch.distributed``'s default process group.

    The agreement runs on a gloo group on the host, so the per-call check costs no device
    synchronisation; with a gloo default group that group is used as it is, unless
    ``own_group``: then a gloo group of its own, created once per default group (every rank
    creates it at its first such :class:`DistributedRanks`, in the same order). The
    batch-size search agrees on its own group: a rank that ran out of memory before one of
    the step's collectives must not have its verdict paired with the collective another
    rank still waits in (docs/design.md section 7, "Batch-size search")."""

    def __init__(self, own_group: bool = False) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self._group = None
        if own_group:
            self._group = agreement_group()
        elif dist.get_backend() != "gloo":
            # CUDA only (NCCL): a host-side group for the plan exchange; every rank creates it.
            self._group = dist.new_group(backend="gloo")

    def any(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32)
        self._dist.all_reduce(value, op=self._dist.ReduceOp.MAX, group=self._group)
        return bool(value.item())

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._dist.get_world_size(self._group)
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]


_AGREEMENT: list[Any] = [None, None]
"""The default group and the gloo group :func:`agreement_group` made for it."""


def agreement_group() -> Any:
    """A gloo group of every rank, for agreements only, created once per default group (a
    collective: every rank calls it first at the same point)."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if _AGREEMENT[0] is not world:
        _AGREEMENT[:] = [world, dist.new_group(backend="gloo")]
    return _AGREEMENT[1]


# ---- the messages ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedCall:
    """The owner's call, on the host, and its key: sharded ranks trace and profile it."""

    args: tuple
    kwargs: dict
    key: InputKey


@dataclass(frozen=True)
class ProfileTogether:
    """The owner found no stored plan and profiles now: sharded ranks profile with it."""


@dataclass(frozen=True)
class SharedPlan:
    """The graph and plan the owner made for its key, as JSON (they pickle small and the
    same in every process), and whether they came from a store (checkpoint, cache)."""

    graph_json: str
    plan_json: str
    from_store: bool

    @classmethod
    def of(cls, graph: Graph, plan: Plan, from_store: bool) -> SharedPlan:
        return cls(graph.to_json(), plan.to_json(), from_store)

    def unpack(self) -> tuple[Graph, Plan, bool]:
        """The graph, the plan and whether they came from a store."""
        return Graph.from_json(self.graph_json), Plan.from_json(self.plan_json), self.from_store


@dataclass(frozen=True)
class PlanningFailed:
    """The error that stopped the owner planning. Where no plan fit, the other ranks raise
    the same :class:`~lightning_remat.errors.RematInfeasibleError` (a batch-size trial records
    it as infeasible on every rank); else a RuntimeError naming it."""

    error: str
    """``"TypeName: message"`` of the owner's error."""
    infeasible: tuple[int, int | None, str, int | None, str, int | None] | None = None
    """The infeasible error's budget, smallest feasible budget, what was tried, the measured
    peak, the cause and the profile's least (:class:`~lightning_remat.errors.RematInfeasibleError`)."""

    @classmethod
    def of(cls, exc: BaseException) -> PlanningFailed:
        infeasible = ((exc.budget_bytes, exc.min_budget_bytes, exc.tried, getattr(exc, "measured_peak_bytes", None),
                       getattr(exc, "cause", ""), getattr(exc, "profiled_least_bytes", None))
                      if isinstance(exc, RematInfeasibleError) else None)
        return cls(f"{type(exc).__name__}: {exc}", infeasible)

    def error_for(self, owner: int) -> Exception:
        """The error a rank that waited for rank ``owner`` raises."""
        if self.infeasible is not None:
            budget, least, tried, peak, cause, profiled = self.infeasible
            return RematInfeasibleError(budget, least, tried, peak, cause=cause, profiled_least_bytes=profiled)
        return RuntimeError(f"lightning_remat: rank {owner} could not plan its input ({self.error}); "
                            "every rank stops with it")


Message = SharedCall | ProfileTogether | SharedPlan | PlanningFailed
"""What an owner broadcasts while it plans a key."""

_M = TypeVar("_M", SharedCall, ProfileTogether, SharedPlan)


class Exchange:
    """The talk about one new key between its owner and the other ranks: the owner sends,
    every other rank receives, message by message (each a broadcast from the owner)."""

    def __init__(self, ranks: Ranks, owner: int) -> None:
        self.ranks = ranks
        self.owner = owner
        self.plan_sent = False
        """Whether the owner has sent its :class:`SharedPlan` (after it, an error is its own)."""

    @property
    def mine(self) -> bool:
        """Whether this rank owns the key (and sends)."""
        return self.owner == self.ranks.rank

    def send(self, message: Message) -> None:
        """The owner: broadcast ``message`` to the ranks receiving it."""
        assert self.mine, "only the key's owner sends"
        self.ranks.broadcast(message, self.owner)
        self.plan_sent = self.plan_sent or isinstance(message, SharedPlan)

    def fail(self, exc: BaseException) -> None:
        """The owner: tell the waiting ranks that ``exc`` stopped it, unless its plan went
        out already (the ranks wait no more)."""
        if not self.plan_sent:
            self.send(PlanningFailed.of(exc))

    def receive(self, *expected: type[_M]) -> _M:
        """Another rank: the owner's next message, which must be one of the ``expected``
        types; the owner's error is raised here."""
        assert not self.mine, "the key's owner sends, it does not receive"
        message = self.ranks.broadcast(None, self.owner)
        if isinstance(message, PlanningFailed):
            raise message.error_for(self.owner)
        if not isinstance(message, expected):
            names = " or ".join(t.__name__ for t in expected)
            raise RuntimeError(f"lightning_remat: rank {self.ranks.rank} waited for {names} from "
                               f"rank {self.owner} and got {message!r}: the ranks planned in "
                               "different orders")
        return message
