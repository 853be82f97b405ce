"""What a rank waiting for a key's owner makes of the owner's messages (the two-rank runs in
test_ddp_shapes.py exercise the whole exchange)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from lightning_remat.errors import RematInfeasibleError
from lightning_remat.messages import Exchange, PlanningFailed, ProfileTogether, SharedPlan


class Waiting:
    """Rank 1 of two: each broadcast from the owner yields the next queued message, pickled
    and unpickled as it would cross processes."""

    rank = 1

    def __init__(self, *messages: Any) -> None:
        self.messages = list(messages)

    def any(self, flag: bool) -> bool:
        return flag

    def gather(self, obj: Any) -> list[Any]:
        return [None, obj]

    def broadcast(self, obj: Any, src: int) -> Any:
        return pickle.loads(pickle.dumps(self.messages.pop(0)))


def test_a_rank_waiting_for_an_infeasible_owner_raises_the_same_error() -> None:
    owner_error = RematInfeasibleError(1000, 4096, "auto")
    exchange = Exchange(Waiting(PlanningFailed.of(owner_error)), owner=0)
    with pytest.raises(RematInfeasibleError) as raised:
        exchange.receive(SharedPlan)
    assert str(raised.value) == str(owner_error)
    assert raised.value.min_budget_bytes == 4096


def test_a_rank_waiting_for_an_owner_that_failed_otherwise_names_the_owner_and_its_error() -> None:
    exchange = Exchange(Waiting(PlanningFailed.of(ValueError("bad loss"))), owner=0)
    with pytest.raises(RuntimeError, match=r"rank 0 could not plan its input \(ValueError: bad loss\)"):
        exchange.receive(SharedPlan)


def test_a_message_out_of_order_is_an_error_not_a_plan() -> None:
    exchange = Exchange(Waiting(ProfileTogether()), owner=0)
    with pytest.raises(RuntimeError, match="waited for SharedPlan from rank 0"):
        exchange.receive(SharedPlan)
    assert isinstance(Exchange(Waiting(ProfileTogether()), owner=0).receive(ProfileTogether, SharedPlan),
                      ProfileTogether)
