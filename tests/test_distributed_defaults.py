"""The strategies on two CPU ranks (gloo) as users run them: Lightning's default logger
(TensorBoard), the default profile settings, a warm plan cache, budgets as a percentage,
bytes and None. ``remat_fsdp`` trains as Lightning's plain ``ModelParallelStrategy`` (FSDP2),
both built with their defaults, parameters, optimizer state and buffers rank by rank, after one
step and after several (the sharded mesh is compared in tests/test_strategy_fsdp.py); the
ranks decide together under uneven load (a busy thread on one rank), and a collective in the
forward (an ``all_reduce``, as SyncBatchNorm runs) neither hangs ``remat_ddp`` nor
``remat_fsdp``. Every scenario runs in one spawn of two ranks (:mod:`tests.distributed`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_remat.lightning.fsdp import RematFSDPStrategy
from lightning_remat.lightning.strategy import RematDDPStrategy
from tests.distributed import run_ranks

STEPS = 3
WIDTH = 64


class Block(nn.Module):
    """LayerNorm, Linear, GELU, Linear, with a residual add: one fully_shard unit."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


@torch.fx.wrap
def summed_across_ranks(x: torch.Tensor) -> torch.Tensor:
    """The batch mean of every rank added to ``x``: an all_reduce, one op to fx (a leaf, as
    SyncBatchNorm's own collective is inside its leaf module)."""
    mean = x.mean(dim=0, keepdim=True).detach().clone()
    torch.distributed.all_reduce(mean)
    return x + mean / torch.distributed.get_world_size()


class SummedAcrossRanks(nn.Module):
    """A collective in the forward (SyncBatchNorm's stand-in on gloo)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return summed_across_ranks(x)


class Net(nn.Module):
    def __init__(self, collective: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(32, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(6)])
        self.sync = SummedAcrossRanks() if collective else nn.Identity()
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.sync(self.blocks(self.stem(x))))


class Model(pl.LightningModule):
    """The held-out model: six residual blocks, each a fully_shard unit, then the root; SGD
    with momentum (optimizer state), batches of 256 rows of 32 features. Saves each rank's
    local shards, optimizer state and buffers after the first step and at the end."""

    def __init__(self, out: Path, shard: bool = True, collective: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Net(collective)
        self.register_buffer("seen", torch.zeros(()))  # a buffer the step changes
        self.out, self.shard = out, shard
        self.batch_size = 256

    def configure_model(self) -> None:
        if not self.shard:
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen += x.shape[0]
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(256 * 2 * STEPS, 32, generator=g),
                             torch.randint(0, 8, (256 * 2 * STEPS,), generator=g))
        return DataLoader(data, batch_size=self.batch_size)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.trainer.global_step == 1:
            self._save("step1")

    def on_fit_end(self):
        self._save("end")
        planner = getattr(self.trainer.strategy, "planner", None)
        if planner is not None:
            plans = {repr(k): [e.plan.to_json(), e.from_cache] for k, e in planner.planned.items()}
            (self.out / f"plans{self.global_rank}.json").write_text(json.dumps(plans))
            from lightning_remat.solvers.policy import plain_peak_bytes

            budgets = [[e.budget_bytes, plain_peak_bytes(e.graph)] for e in planner.planned.values()]
            (self.out / f"budgets{self.global_rank}.json").write_text(json.dumps(budgets))

    def _save(self, when: str) -> None:
        def local(value):
            value = value.to_local() if hasattr(value, "to_local") else value
            return value.detach().clone() if isinstance(value, torch.Tensor) else value

        state = {k: local(v) for k, v in self.state_dict().items()}
        optim = {i: {k: local(v) for k, v in s.items()}
                 for i, s in self.trainer.optimizers[0].state_dict()["state"].items()}
        torch.save({"state": state, "optim": optim}, self.out / f"{when}{self.global_rank}.pt")


def _fit(out: Path, strategy, root: Path | None = None, **model_kwargs) -> pl.Trainer:
    """Lightning's defaults but for the CPU, two devices and no progress bar: the default
    logger (TensorBoard) and checkpointing on."""
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                         default_root_dir=str(root or out), enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Model(out, **model_kwargs))
    return trainer


def _fsdp() -> ModelParallelStrategy:
    """Lightning's own strategy with Lightning's own defaults, as ``RematFSDPStrategy()`` is
    given below: the same mesh (a data-parallel group per node, the processes of a node its
    tensor-parallel group), the same sampler, the same training."""
    return ModelParallelStrategy()


# ---- the scenarios, run by both ranks in order ---------------------------------------------


def plain(rank: int, out: Path) -> None:
    _fit(out, _fsdp())


def percent_under_uneven_load(rank: int, out: Path) -> None:
    """75% of the plain peak, rank one's timings disturbed by a busy thread throughout."""
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            sum(i * i for i in range(20_000))

    thread = threading.Thread(target=busy, daemon=True)
    if rank == 1:
        thread.start()
    try:
        _fit(out, RematFSDPStrategy(memory_budget="75%"))
    finally:
        stop.set()


def none_cold(rank: int, out: Path) -> None:
    _fit(out, RematFSDPStrategy(memory_budget=None), root=out.parent / "shared_root")


def none_warm(rank: int, out: Path) -> None:
    """Budget None again with the plan cache the run before left in default_root_dir."""
    _fit(out, RematFSDPStrategy(memory_budget=None), root=out.parent / "shared_root")


def bytes_budget(rank: int, out: Path) -> None:
    _fit(out, RematFSDPStrategy(memory_budget=1_300_000))


def collective_in_forward_ddp(rank: int, out: Path) -> None:
    _fit(out, RematDDPStrategy(memory_budget="50%", process_group_backend="gloo"), shard=False,
         collective=True)


def collective_in_forward_fsdp(rank: int, out: Path) -> None:
    _fit(out, RematFSDPStrategy(memory_budget="75%"), collective=True)


def trial_with_uneven_budgets(rank: int, out: Path) -> None:
    """A batch-size trial under memory_budget=None where rank one has far less memory free
    than rank zero, whose budget the plan is made for: every rank finds it infeasible before
    running a step (on a GPU, rank one would run out of memory inside FSDP's collectives)."""
    import dataclasses

    from pytorch_lightning.utilities.exceptions import _TunerExitException

    import lightning_remat.device as device_module
    import lightning_remat.lightning.trial as trial_module
    from lightning_remat.planner import PlanSettings

    class Probe(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            # The free memory each rank reads: for the plan (the optimizer's state in place)
            # and for the verdict.
            device_module.default_budget = trial_module.default_budget = (
                lambda device: 10**9 if rank == 0 else 50_000)
            steps = []
            pl_module.on_before_backward = lambda loss: steps.append(1)  # a step's backward ran
            settings = trial_module.SearchSettings(
                plan=PlanSettings(None), budget_bytes=10**9, device=torch.device("cpu"), target=None,
                cache_dir=out / "cache", budget_from_device=True)
            trial = trial_module.LightningTrial(trainer, pl_module, batch_arg_name="batch_size", steps_per_trial=1,
                                                solver="auto", settings=settings)
            result = trial(256)
            (out / f"trial{rank}.json").write_text(json.dumps({**dataclasses.asdict(result), "steps": len(steps)}))
            raise _TunerExitException()

    trainer = pl.Trainer(strategy=RematFSDPStrategy(), accelerator="cpu", devices=2, max_steps=1,
                         default_root_dir=str(out), enable_progress_bar=False, enable_model_summary=False,
                         logger=False, callbacks=[Probe()])
    trainer.fit(Model(out))


SCENARIOS = [plain, percent_under_uneven_load, none_cold, none_warm, bytes_budget,
             collective_in_forward_ddp, collective_in_forward_fsdp, trial_with_uneven_budgets]


@pytest.fixture(scope="module")
def ranks_ran(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    run_ranks(out, SCENARIOS)
    return out


def _assert_same(a: Path, b: Path) -> None:
    for when in ("step1", "end"):
        for rank in (0, 1):
            ra = torch.load(a / f"{when}{rank}.pt", weights_only=False)
            rb = torch.load(b / f"{when}{rank}.pt", weights_only=False)
            assert ra["state"].keys() == rb["state"].keys()
            for name in ra["state"]:
                assert torch.equal(ra["state"][name], rb["state"][name]), (when, rank, name)
            assert ra["optim"] and ra["optim"].keys() == rb["optim"].keys()
            for i in ra["optim"]:
                for k in ra["optim"][i]:
                    assert torch.equal(torch.as_tensor(ra["optim"][i][k]),
                                       torch.as_tensor(rb["optim"][i][k])), (when, rank, i, k)


def _plans(out: Path) -> list[dict]:
    return [json.loads((out / f"plans{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["percent_under_uneven_load", "none_cold", "none_warm", "bytes_budget"])
def test_remat_fsdp_trains_as_plain_fsdp_with_lightning_defaults(ranks_ran, scenario):
    out = ranks_ran / scenario
    _assert_same(ranks_ran / "plain", out)
    plans = _plans(out)
    assert plans[0] and plans[0] == plans[1]  # every rank ran rank zero's plan
    root = ranks_ran / "shared_root" if scenario.startswith("none") else out
    assert list((root / "lightning_logs").glob("version_*/events.*"))  # the default logger wrote
    if scenario in ("percent_under_uneven_load", "bytes_budget"):
        assert any('"recompute"' in plan for plan, _ in plans[0].values())
        # The budget as remat() reads it (tests/test_one_budget.py): bytes as given, a
        # fraction of the plain peak of the graph planned, on every rank.
        for rank in (0, 1):
            for budget, plain in json.loads((out / f"budgets{rank}.json").read_text()):
                assert budget == (1_300_000 if scenario == "bytes_budget" else int(0.75 * plain))
    cached = [from_cache for _, from_cache in plans[0].values()]
    assert all(cached) if scenario == "none_warm" else not any(cached)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["collective_in_forward_ddp", "collective_in_forward_fsdp"])
def test_collective_in_forward_profiles_on_every_rank(ranks_ran, scenario):
    plans = _plans(ranks_ran / scenario)
    assert plans[0] and plans[0] == plans[1]
    assert any('"recompute"' in plan for plan, _ in plans[0].values())
    if scenario == "collective_in_forward_ddp":  # remat_ddp's "50%": of the planned graph's plain peak
        for rank in (0, 1):
            for budget, plain in json.loads((ranks_ran / scenario / f"budgets{rank}.json").read_text()):
                assert budget == int(0.5 * plain)


@pytest.mark.slow
def test_a_trial_is_judged_by_every_ranks_budget_before_it_runs(ranks_ran):
    trials = [json.loads((ranks_ran / "trial_with_uneven_budgets" / f"trial{r}.json").read_text()) for r in (0, 1)]
    assert trials[0] == trials[1]  # one verdict
    assert not trials[0]["feasible"] and "rank 1" in trials[0]["reason"] and trials[0]["steps"] == 0
