"""The whole job on the zoo's transformers: GPT-2, Qwen2, T5 and BERT (tiny, their configs'
defaults kept: the cache, the attention implementation and dropout as shipped), each trained
by ``lightning.Trainer`` under ``RematStrategy`` with the Trainer's default logger
(TensorBoard) and ``RematBatchSizeFinder``, at a byte budget where plain training fits
batch ``B``: plain training's measured peak at ``B``.

Checked for each model:

- remat's searched size is above plain's, and plain's is ``B``;
- the step trained at the searched size reads, on the search's meter, no more than the
  search's trial there, within the budget; the plan's forward and backward (what a budget
  bounds) at that size is within the budget at the allocator's edge (``benchmarks/edge.py``:
  the kernel's resident high-water mark in a process whose glibc maps every buffer of a page
  or more on its own) at the third step of a fit without a logger. At these sizes a fifth of
  what a step allocates is under 64 KiB: with the edge's usual threshold (64 KiB) such buffers
  come from the heap, and the fit's third step of Qwen2's plan read 2.58 to 3.42 MB from run to
  run against 2.80 MB on the meter and a 3.12 MB budget (2026-12-07, 2-core CPU); with every
  buffer of a page or more mapped, five runs read 2.47 to 2.58 MB. At the second step of the
  fit, the edge read under the meter by what the planning step left and the step freed (T5:
  6.66 MB against 11.49 MB). Not in the searched fit: its TensorBoard logger brings
  ``MemoryTimelineLogger``, whose meter (the profiler) keeps records of the step's ops in
  host memory outside the budget (docs/design.md section 6, "What a budget bounds"): about
  2.2 MB at the end of Qwen2's planned forward and backward at batch 3 (a budget of
  3,122,212 B), whose edge read 3.39 to 4.80 MB in such a fit against 2,638,352 B on the
  meter, and 2.35 to 2.52 MB without the logger (2026-12-07, 2-core CPU). A fit's batches
  differ, too: one with a padded row reads 262,144 B more on the meter (Qwen2's plain step
  at ``B``: 3,122,192 B against 2,860,048 B);
- the first trained step's gradients are plain Lightning's at that size, to the bit (to float
  rounding only where the plan runs ops out of the forward's order, its ``order:`` note:
  docs/design.md section 5, "Plain's order");
- the timeline logged when the plan was made, read back with TensorBoard's reader, has one
  measured point per predicted op, forward and backward.

The job runs in one child process started for the allocator's edge (its environment must
be set before the C library starts); the event files are read back here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow  # one child: four models searched, trained and compared, 58 s of CPU

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("gpt2", "qwen2", "t5", "bert")
VOCAB, LENGTH, B = 128, 128, 2
MAX_VAL = B + 1
"""The search's largest size: remat's answer above plain's is its one trial, a plan that fits
(a size with no plan costs the solver's search for the smallest budget, seconds here)."""
SAMPLES = 8 * B
"""Every batch of the search and of the fits comes from these."""


def build(name: str) -> torch.nn.Module:
    """A tiny random-init model of ``name`` with its LM head; sizes set, all else its
    config's defaults."""
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH)
        return transformers.GPT2LMHeadModel(config)
    if name == "qwen2":
        config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                          max_position_embeddings=LENGTH)
        return transformers.Qwen2ForCausalLM(config)
    if name == "t5":
        # The decoder's first input, which labels are shifted behind (this version's
        # config has no default for it).
        config = transformers.T5Config(vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=2,
                                       num_decoder_layers=2, num_heads=2, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(config)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=128, max_position_embeddings=LENGTH)
    return transformers.BertForMaskedLM(config)


def samples() -> list[dict[str, torch.Tensor]]:
    """Token rows, every fourth with its last quarter padded (``labels`` -100 there)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (SAMPLES, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[::4, -LENGTH // 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]


def job(name: str, root: Path) -> dict[str, Any]:
    """In the edge child: the job on one model; what the test checks, as JSON."""
    import lightning as L
    from torch.utils.data import DataLoader

    from benchmarks.edge import edge_peak_bytes
    from lightning_remat.measure.peak import peak_bytes
    from lightning_remat.unified import RematBatchSizeFinder, RematStrategy

    rows = samples()

    class Job(L.LightningModule):
        """The model on the rows; the steps in ``metered`` (global steps) have their forward
        and backward measured with the search's meter, gradients freed before it."""

        def __init__(self) -> None:
            super().__init__()
            self.net = build(name)
            self.batch_size = B
            self.metered: set[int] = set()
            self.peaks: list[int] = []
            self.edged: set[int] = set()
            self.edges: list[int] = []
            self.first_grads: dict[str, torch.Tensor] | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(**batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return DataLoader(rows, batch_size=self.batch_size)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if self.first_grads is None:
                self.first_grads = {k: p.grad.clone() for k, p in self.named_parameters() if p.grad is not None}

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            step_index = self.trainer.global_step
            if step_index not in self.metered | self.edged:
                return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

            def metered() -> Any:
                out: list[Any] = [None]

                def step() -> None:
                    out[0] = optimizer_closure()

                self.zero_grad(set_to_none=True)  # freed before the step, which allocates them
                if step_index in self.metered:
                    self.peaks.append(peak_bytes(step))
                else:
                    self.edges.append(edge_peak_bytes(step))
                return out[0]

            optimizer.step(closure=metered)

    def fit(module: Job, strategy: Any, steps: int, folder: str, **kwargs: Any) -> L.Trainer:
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps,
                            default_root_dir=str(root / folder), enable_checkpointing=False,
                            enable_model_summary=False, enable_progress_bar=False, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the cache notice, Lightning's hints
            trainer.fit(module)
        return trainer

    # Plain training's peak at B, the larger of two steps: the budget.
    L.seed_everything(0, verbose=False)
    plain = Job()
    plain.metered = {0, 1}
    fit(plain, "auto", 2, "plain", logger=False)
    budget = max(plain.peaks)

    # The job: the search, then training at the size found; the default logger.
    L.seed_everything(0, verbose=False)
    model = Job()
    model.metered = {1}  # the step after the one that plans
    finder = RematBatchSizeFinder(init_val=B, max_val=MAX_VAL, steps_per_trial=1, progress_bar=False)
    trainer = fit(model, RematStrategy(memory_budget=budget), 2, "remat", callbacks=[finder])
    (entry,) = trainer.strategy.planner.planned.values()
    report = finder.report

    # Plain Lightning from the same seed at the size found: its first step's gradients.
    L.seed_everything(0, verbose=False)
    reference = Job()
    reference.batch_size = model.batch_size
    fit(reference, "auto", 1, "reference", logger=False)
    # The plan's step inside a fit at the size found, at the edge: forward and backward, what
    # a budget bounds, in a fit without a logger (the logger's MemoryTimelineLogger meters
    # each step, and its profiler's records are outside the budget: docs/design.md section 6).
    L.seed_everything(0, verbose=False)
    inside = Job()
    inside.batch_size = model.batch_size
    inside.edged = {2}  # past the step that plans and the one after it
    fit(inside, RematStrategy(memory_budget=budget), 3, "inside", logger=False)

    differing = {k: float((g - reference.first_grads[k]).abs().max())
                 for k, g in model.first_grads.items() if not torch.equal(g, reference.first_grads[k])}
    return {
        "budget": budget, "plain_size": report.plain.largest_feasible, "remat_size": report.remat.largest_feasible,
        "trained_size": model.batch_size, "trained": model.peaks, "edge_in_fit": inside.edges,
        "trials": [(r.batch_size, r.feasible, r.peak_bytes) for r in report.remat.trials],
        "predicted": entry.plan.predicted_peak_bytes,
        "notes": entry.plan.notes, "recomputed": entry.plan.count("recompute"),
        "gradients": sorted(model.first_grads) == sorted(reference.first_grads), "differing": differing,
        "events": [e.phase for e in entry.predicted_timeline().events], "log_dir": trainer.logger.log_dir,
    }


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every model's job, in one child process set up for the allocator's edge."""
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    pytest.importorskip("tensorboard")
    if not sys.platform.startswith("linux"):
        pytest.skip("the allocator's edge reads /proc/self/status")
    from benchmarks.edge import child_env

    root = tmp_path_factory.mktemp("zoo_job")
    code = ("import json, sys, torch\n"
            "from pathlib import Path\n"
            "from tests.test_zoo_job import MODELS, job\n"
            "torch.set_num_threads(1)\n"
            f"print(json.dumps({{name: job(name, Path({str(root)!r}) / name) for name in MODELS}}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=child_env(mmap_threshold=4096, PYTHONPATH=str(ROOT)), timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", MODELS)
def test_the_search_finds_more_than_plain_and_the_step_trained_there_holds_the_budget_at_the_edge(
        name: str, jobs: dict[str, dict[str, Any]]) -> None:
    job = jobs[name]
    assert job["plain_size"] == B, job
    assert job["remat_size"] > job["plain_size"] and job["trained_size"] == job["remat_size"], job
    assert job["recomputed"] > 0, job["notes"]
    # The fit's step at that size read what the search's trial did, within the budget.
    ((size, feasible, trial),) = [t for t in job["trials"] if t[0] == job["remat_size"]]
    (trained,) = job["trained"]
    assert feasible and trained <= trial <= job["budget"], job
    (in_fit,) = job["edge_in_fit"]
    assert 0 < in_fit <= job["budget"], job


@pytest.mark.parametrize("name", MODELS)
def test_the_first_trained_step_has_plain_lightnings_gradients(name: str, jobs: dict[str, dict[str, Any]]) -> None:
    job = jobs[name]
    assert job["gradients"], "the same parameters have gradients"
    if any(note.startswith("order:") for note in job["notes"]):
        # Stages out of the forward's order can sum a gradient otherwise.
        assert all(apart <= 1e-6 for apart in job["differing"].values()), job["differing"]
    else:
        assert not job["differing"], job["differing"]


@pytest.mark.parametrize("name", MODELS)
def test_the_logged_timeline_has_a_measured_point_per_predicted_op(name: str, jobs: dict[str, dict[str, Any]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = jobs[name]
    acc = EventAccumulator(job["log_dir"], size_guidance={"scalars": 0})
    acc.Reload()
    n = len(job["events"])
    predicted = acc.Scalars("remat/timeline/predicted_MiB")
    measured = acc.Scalars("remat/timeline/measured_MiB")
    assert [e.step for e in measured] == [e.step for e in predicted] == list(range(n))
    assert {"forward", "backward"} <= set(job["events"])
    assert all(e.value > 0 for e in measured)
