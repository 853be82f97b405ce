"""DDP ranks that meet different input shapes agree before any plan is exchanged: no
collective is called by some ranks only, and each rank runs the plan made for its own shape
(a short last batch on one rank, a per-rank padding)."""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import lightning_remat.planner as planner_module
from lightning_remat.inputs import shapes_of
from lightning_remat.lightning.strategy import RematDDPStrategy
from lightning_remat.planner import Planner, PlanSettings
from tests.lit_models import ConvNet, loaders, trainer_kwargs

pytestmark = pytest.mark.filterwarnings("ignore:lightning_remat. the inputs differ")


class ThreadRanks:
    """Ranks as threads in one process. A collective posts this rank's value and waits for
    every rank at a barrier (a rank calling a collective the others skip times out there,
    as NCCL would hang); between collectives one rank runs at a time."""

    def __init__(self, rank: int, hub: dict[str, Any]) -> None:
        self.rank = rank
        self.hub = hub
        self.calls: list[str] = []

    def _exchange(self, kind: str, value: Any) -> list[Any]:
        hub = self.hub
        self.calls.append(kind)
        hub["slots"][self.rank] = (kind, value)
        hub["lock"].release()
        try:
            hub["barrier"].wait()
            with hub["lock"]:
                posted = list(hub["slots"])
            hub["barrier"].wait()
        finally:
            hub["lock"].acquire()
        assert len({k for k, _ in posted}) == 1, f"ranks called different collectives: {posted}"
        return [v for _, v in posted]

    def any(self, flag: bool) -> bool:
        return any(self._exchange("any", flag))

    def gather(self, obj: Any) -> list[Any]:
        return self._exchange("gather", obj)

    def broadcast(self, obj: Any, src: int) -> Any:
        return self._exchange(f"broadcast{src}", obj)[src]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(16) for m in (nn.Linear(32, 32), nn.Tanh())])


def _run_ranks(batches_by_rank: list[list[torch.Tensor]], budget: Any = None) -> list[dict[str, Any]]:
    """Train step by step on every rank (threads); per rank: its planner, its collectives,
    the batch shapes of the plans it ran, and the error it raised (if any)."""
    world = len(batches_by_rank)
    hub = {"slots": [None] * world, "lock": threading.Lock(), "barrier": threading.Barrier(world, timeout=10)}
    base = _mlp()
    results: list[dict[str, Any]] = [{} for _ in range(world)]

    def rank_main(rank: int) -> None:
        hub["lock"].acquire()
        try:
            ranks = ThreadRanks(rank, hub)
            planner = Planner(copy.deepcopy(base), PlanSettings(budget, profile_repeats=1), ranks=ranks)
            results[rank].update(planner=planner, ranks=ranks, ran=[])
            for x in batches_by_rank[rank]:
                planner(x).sum().backward()
                results[rank]["ran"].append(shapes_of(planner.last.key))
        except Exception as exc:  # reported per rank to the test
            results[rank]["error"] = exc
        finally:
            hub["lock"].release()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def _batches(*sizes: int) -> list[torch.Tensor]:
    return [torch.randn(n, 32) for n in sizes]


@pytest.fixture
def profiled(monkeypatch):
    """Which threads profiled which batch sizes."""
    seen: list[tuple[str, int]] = []
    original = planner_module.profile_module

    def recording(module, args, **kwargs):
        seen.append((threading.current_thread().name, args[0].shape[0]))
        return original(module, args, **kwargs)

    monkeypatch.setattr(planner_module, "profile_module", recording)
    return seen


def test_a_short_last_batch_on_one_rank_is_planned_by_that_rank_and_nobody_hangs(profiled):
    results = _run_ranks([_batches(512, 512, 512), _batches(512, 512, 100)])
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    assert results[0]["ranks"].calls == results[1]["ranks"].calls
    assert results[0]["ran"] == [[[512, 32]]] * 3
    assert results[1]["ran"] == [[[512, 32]], [[512, 32]], [[100, 32]]]  # its own plan, not rank 0's
    # Each new shape is profiled once by every rank together (its owner's input sent to the
    # others), as a forward holding a collective (SyncBatchNorm) needs: never by one rank alone.
    assert sorted(size for _, size in profiled) == [100, 100, 512, 512]
    # Rank 0 keeps rank 1's plan for when it meets that shape itself: no new profile then.
    assert results[1]["planner"].last.key in results[0]["planner"].planned


def test_ranks_with_different_new_shapes_at_one_step_each_get_their_own_plan(profiled):
    results = _run_ranks([_batches(512, 256, 256, 128), _batches(512, 384, 256, 256)])
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    assert results[0]["ranks"].calls == results[1]["ranks"].calls
    assert [s[0][0] for s in results[0]["ran"]] == [512, 256, 256, 128]
    assert [s[0][0] for s in results[1]["ran"]] == [512, 384, 256, 256]
    assert sorted(size for _, size in profiled) == [128, 128, 256, 256, 384, 384, 512, 512]  # once, by every rank


def test_a_rank_that_cannot_plan_stops_every_rank_with_its_reason():
    results = _run_ranks([_batches(512, 512), _batches(512, 100)], budget=2048)
    errors = [r.get("error") for r in results]
    assert all(errors), errors  # nobody hangs, nobody trains on
    assert "smallest feasible budget" in str(errors[0])
    # The waiting rank raises the same error (a batch-size trial then records both as infeasible).
    assert type(errors[1]) is type(errors[0]) and str(errors[1]) == str(errors[0])


# ---- the same on two real processes (gloo), through Lightning ------------------------------
class UnevenConvNet(ConvNet):
    """Rank 1 changes its batch at ``step``: a smaller image (``"image"``) or fewer samples
    (``"short"``); each rank writes the input shapes of the plans it ran."""

    def __init__(self, out_dir, change: str, step: int) -> None:
        super().__init__()
        self.out_dir, self.change, self.step = out_dir, change, step
        self.ran: list = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1 and batch_idx == self.step:
            x, y = (x[..., :16, :16], y) if self.change == "image" else (x[:3], y[:3])
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.ran.append(shapes_of(self.trainer.strategy.planner.last.key))
        return loss

    def on_train_end(self):
        (self.out_dir / f"rank{self.global_rank}.json").write_text(json.dumps(self.ran))


def _uneven_fit(tmp_path, change: str, step: int) -> list[list]:
    pl.seed_everything(0)
    model = UnevenConvNet(tmp_path, change, step)
    strategy = RematDDPStrategy(memory_budget="60%", cache_dir=tmp_path / "cache", start_method="spawn",
                                process_group_backend="gloo")
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(tmp_path, devices=2, max_epochs=1,
                                                             limit_train_batches=step + 1))
    trainer.fit(model, loaders(n=64, batch_size=8)[0])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_one_rank_with_a_smaller_image_at_one_step_trains_on(tmp_path):
    rank0, rank1 = _uneven_fit(tmp_path, "image", step=1)
    assert rank0 == [[[8, 3, 32, 32]]] * 2
    assert rank1 == [[[8, 3, 32, 32]], [[8, 3, 16, 16]]]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_a_short_last_batch_on_one_rank_trains_on(tmp_path):
    rank0, rank1 = _uneven_fit(tmp_path, "short", step=2)
    assert rank0 == [[[8, 3, 32, 32]]] * 3
    assert rank1 == [[[8, 3, 32, 32]]] * 2 + [[[3, 3, 32, 32]]]
