"""The batch-size search across ranks: one study on rank zero, every rank runs each trial, a
size fits only where it fits on every rank, every rank trains at the answer (2 CPU processes
under remat_ddp and remat_fsdp; the agreement itself with threads as ranks)."""

from __future__ import annotations

import json
import threading

import pytest
import pytorch_lightning as pl
import torch

from lightning_remat.lightning.batch_size import RematBatchSizeFinder
from lightning_remat.lightning.fsdp import RematFSDPStrategy
from lightning_remat.lightning.strategy import RematDDPStrategy
from lightning_remat.tuning import TrialResult, combine_trials, run_search_across_ranks
from tests.lit_models import trainer_kwargs
from tests.test_ddp_shapes import ThreadRanks
from tests.test_strategy_fsdp import ShardedNet


class SearchedNet(ShardedNet):
    """Writes, per rank, the size the search chose and the size of the batches it trained on."""

    def __init__(self, out_dir, shard: bool = True) -> None:
        super().__init__(batch_size=8)
        self.record_dir = out_dir
        self.shard = shard
        self.trained_on: list[int] = []

    def configure_model(self) -> None:
        if self.shard:
            super().configure_model()

    def on_train_start(self):
        self.trained_on = []  # the trials' steps ran before

    def training_step(self, batch, batch_idx):
        self.trained_on.append(int(batch[0].shape[0]))
        return super().training_step(batch, batch_idx)

    def on_fit_end(self):
        finder = next(cb for cb in self.trainer.callbacks if isinstance(cb, RematBatchSizeFinder))
        report = finder.report
        record = {
            "batch_size": self.batch_size, "trained_on": self.trained_on,
            "largest": report.remat.largest_feasible, "smallest_infeasible": report.remat.smallest_infeasible,
            "plain_largest": report.plain.largest_feasible if report.plain else None,
        }
        (self.record_dir / f"search{self.global_rank}.json").write_text(json.dumps(record))

    def teardown(self, stage):
        if not self.shard and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # DDP: ranks leave the gloo group together
            torch.distributed.destroy_process_group()


def _search(tmp_path, strategy, shard):
    finder = RematBatchSizeFinder(memory_budget="192KiB", init_val=16, max_val=512, steps_per_trial=1,
                                  progress_bar=False)
    trainer = pl.Trainer(strategy=strategy, callbacks=[finder],
                         **trainer_kwargs(tmp_path, devices=2, max_steps=2, deterministic=False))
    trainer.fit(SearchedNet(tmp_path, shard=shard))
    return [json.loads((tmp_path / f"search{r}.json").read_text()) for r in (0, 1)]


def _check(records):
    assert records[0] == records[1]  # one answer, on every rank
    found = records[0]
    assert found["largest"] and found["batch_size"] == found["largest"]
    assert found["smallest_infeasible"] == found["largest"] + 1  # the bracket closed
    assert found["trained_on"] == [found["largest"]] * 2  # every rank's dataloader got it
    assert found["largest"] >= found["plain_largest"]


@pytest.mark.slow
def test_search_under_remat_fsdp(tmp_path):
    strategy = RematFSDPStrategy(memory_budget="192KiB", cache_dir=tmp_path / "cache", start_method="spawn",
                                 profile_steps=1)
    _check(_search(tmp_path, strategy, shard=True))


@pytest.mark.slow
def test_search_under_remat_ddp(tmp_path):
    strategy = RematDDPStrategy(memory_budget="192KiB", cache_dir=tmp_path / "cache", start_method="spawn",
                                process_group_backend="gloo", profile_steps=1)
    _check(_search(tmp_path, strategy, shard=False))


def test_a_size_fits_only_where_it_fits_on_every_rank():
    combined = combine_trials([TrialResult(True, peak_bytes=100, seconds=0.1),
                               TrialResult(False, peak_bytes=300, seconds=0.2, reason="over")])
    assert not combined.feasible and combined.peak_bytes == 300 and combined.seconds == 0.2
    assert combined.reason == "rank 1: over"


def test_one_study_on_rank_zero_every_rank_runs_each_trial():
    """Rank 1 needs 3 bytes per sample, rank 0 one; the budget is 300 bytes: the answer is
    rank 1's (100), on both ranks, and both ran the same sizes."""
    world = 2
    hub = {"slots": [None] * world, "lock": threading.Lock(), "barrier": threading.Barrier(world, timeout=20)}
    ran: list[list[int]] = [[], []]
    results: list = [None, None]

    def rank_main(rank: int) -> None:
        hub["lock"].acquire()
        try:
            def trial(batch_size: int) -> TrialResult:
                ran[rank].append(batch_size)
                peak = batch_size * (1 + 2 * rank)
                return TrialResult(peak <= 300, peak_bytes=peak, seconds=0.01)

            results[rank] = run_search_across_ranks(trial, ThreadRanks(rank, hub), init_val=2, max_val=1024)
        finally:
            hub["lock"].release()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0].largest_feasible == results[1].largest_feasible == 100
    assert ran[0] == ran[1] and len(ran[0]) == results[0].trials_run
