"""The zoo's Hugging Face models fine-tuned as users run them: each model's config as it ships
(the cache on, sdpa attention, dropout as configured), a dict batch, the model's own loss
from labels, in a ``LightningModule`` under ``Trainer(strategy=RematStrategy("50%"))``,
against the same module trained plainly from the same seed.

Per model, in a fresh process: the capture path and vertices of the strategy's plan, its
predicted peak and extra time (the plan's predicted seconds as a share of the plain step
timed below, as the measured extra is), one step's measured peak (the library's meter, gradients
freed before the step so allocating them is part of it) and extra time (the median of
``--repeats`` steps, alternating with plain steps of the plainly trained module in the same
process), and whether the weights after ``STEPS`` AdamW steps equal plain training's to the
bit. Then a child started at the allocator's edge (``benchmarks/edge.py``) trains again
with the plan cache the first process wrote, so it runs the same plan, and measures one
step of each at the edge.

    python benchmarks/strategy_transformers.py                 # every model
    python benchmarks/strategy_transformers.py --models gpt2 bert

Results go to ``benchmarks/results/strategy/<tag>.json`` and the table to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "strategy"
MiB = 2**20
MODELS = ("gpt2", "qwen2", "llama", "t5", "bert")
VOCAB, SEQUENCE, BATCH, STEPS = 1000, 128, 8, 4


def build(name: str) -> Any:
    """The model, its config's defaults kept but for its size (4 layers, hidden 128)."""
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=VOCAB,
                                                n_positions=SEQUENCE))
    if name == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE))
    if name == "llama":  # examples/hf_finetune.py's
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE))
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=384, num_layers=4, num_decoder_layers=4,
            num_heads=4, decoder_start_token_id=0))  # T5's checkpoints set it; labels need it
    if name == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(
            vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=384, max_position_embeddings=SEQUENCE))
    raise ValueError(name)


def batches(name: str) -> list[dict[str, Any]]:
    """``STEPS`` batches as a data module would give them: for the encoder, padded rows with
    their attention mask and masked-LM labels (-100 where not masked); for T5, labels the
    decoder's inputs are made from; for decoders, labels equal to the inputs."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=g)
        if name == "bert":
            lengths = torch.randint(SEQUENCE // 2, SEQUENCE + 1, (BATCH,), generator=g)
            mask = (torch.arange(SEQUENCE)[None] < lengths[:, None]).long()
            chosen = (torch.rand(BATCH, SEQUENCE, generator=g) < 0.15) & mask.bool()
            labels = torch.where(chosen, ids, torch.full_like(ids, -100))
            out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
        elif name == "t5":
            out.append({"input_ids": ids, "labels": torch.randint(0, VOCAB, (BATCH, SEQUENCE // 2), generator=g)})
        else:
            out.append({"input_ids": ids, "labels": ids})
    return out


def train(name: str, strategy: Any, root: str) -> Any:
    """The LightningModule after ``STEPS`` AdamW steps under ``strategy``."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader

    class FineTune(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build(name)

        def forward(self, batch: dict[str, Any]) -> Any:
            return self.model(**batch).loss

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            return self(batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    pl.seed_everything(0, verbose=False)
    module = FineTune()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                         default_root_dir=root, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(batches(name), batch_size=None))  # each a dict batch
    return module.train()


def measure(name: str, cache_dir: str, repeats: int, edge: bool) -> dict[str, Any]:
    import torch

    from lightning_remat import RematStrategy
    from lightning_remat.measure.peak import peak_bytes

    root = tempfile.mkdtemp()
    plain = train(name, "auto", os.path.join(root, "plain"))
    strategy = RematStrategy(memory_budget="50%", cache_dir=cache_dir)
    remat = train(name, strategy, os.path.join(root, "remat"))
    (entry,) = strategy.planner.planned.values()
    batch = batches(name)[0]

    def step(module: Any) -> Any:
        def run() -> None:
            torch.manual_seed(1)
            module(batch).backward()
        return run

    planned_step, plain_step = step(entry.module), step(plain)
    for module in (plain, remat):
        module.zero_grad(set_to_none=True)
    if edge:
        from benchmarks.edge import edge_peak_bytes

        plain_step(), planned_step()
        plain.zero_grad(set_to_none=True), remat.zero_grad(set_to_none=True)
        row = {"edge_plain_peak_bytes": edge_peak_bytes(plain_step)}
        row["edge_peak_bytes"] = edge_peak_bytes(planned_step)
        row["from_cache"] = bool(entry.from_cache)
        return row
    apart = max(float((a - b).detach().abs().max()) for a, b in zip(plain.parameters(), remat.parameters()))
    row: dict[str, Any] = {
        "capture": entry.plan.notes[0] if entry.plan.notes else "",
        "vertices": len(entry.graph), "solver": entry.plan.solver,
        "recomputed": entry.plan.count("recompute"), "stages": len(entry.plan.stages),
        "budget_bytes": entry.budget_bytes, "predicted_peak_bytes": entry.plan.predicted_peak_bytes,
        "predicted_extra_seconds": entry.plan.predicted_extra_seconds,
        "profiled_step_seconds": entry.graph.meta.step_seconds,
        "weights_equal": all(torch.equal(a, b) for a, b in zip(plain.parameters(), remat.parameters())),
        "weights_apart": apart, "order_note": any(n.startswith("order:") for n in entry.plan.notes),
    }
    plain_step(), planned_step()
    plain.zero_grad(set_to_none=True)
    row["plain_peak_bytes"] = peak_bytes(plain_step)
    remat.zero_grad(set_to_none=True)
    row["peak_bytes"] = peak_bytes(planned_step)
    spent: dict[str, list[float]] = {"plain": [], "remat": []}
    for _ in range(repeats):
        for key, fn, module in (("plain", plain_step, plain), ("remat", planned_step, remat)):
            module.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            spent[key].append(time.perf_counter() - t0)
    row["plain_step_seconds"] = statistics.median(spent["plain"])
    row["measured_extra"] = statistics.median(spent["remat"]) / row["plain_step_seconds"] - 1
    # The prediction as a share of the plain step timed here, as the measurement is: the
    # profile's step is an instrumented one (on the Qwen2, 171 ms where the plain step took 121).
    row["predicted_extra"] = row["predicted_extra_seconds"] / row["plain_step_seconds"]
    return row


def spawn(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True,
                          env=env, timeout=1200)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def table(record: dict[str, Any]) -> list[str]:
    out = ["| model | capture, vertices | plan | budget MiB | predicted / measured peak MiB | at the edge MiB "
           "| predicted / measured extra time | weights after 4 steps |",
           "|---|---|---|---:|---:|---:|---:|---|"]
    for name, row in record["rows"].items():
        if "peak_bytes" not in row:
            out.append(f"| {name} | failed: {row.get('error', '')} | | | | | | |")
            continue
        capture = row["capture"].removeprefix("capture: ").split(" (")[0].split(",")[0] + f", {row['vertices']}"
        edge = f"{row['edge_peak_bytes'] / MiB:.2f}" if "edge_peak_bytes" in row else row.get("edge_error", "-")
        equal = "equal" if row["weights_equal"] else f"apart by {row['weights_apart']:.1e}"
        out.append(f"| {name} | {capture} | {row['solver']}, {row['recomputed']} of {row['stages']} recomputed "
                   f"| {row['budget_bytes'] / MiB:.2f} | {row['predicted_peak_bytes'] / MiB:.2f} / "
                   f"{row['peak_bytes'] / MiB:.2f} | {edge} | {100 * row['predicted_extra']:+.0f}% / "
                   f"{100 * row['measured_extra']:+.0f}% | {equal} |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tag", default="cpu")
    args = p.parse_args(argv)
    import torch
    import transformers

    from benchmarks.edge import child_env
    from benchmarks.run import git_commit

    started = time.time()
    record: dict[str, Any] = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(allow_dirty=True), "rows": {}}
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in args.models:
        with tempfile.TemporaryDirectory() as cache_dir:
            row = spawn([name, cache_dir, str(args.repeats), "0"], env)
            if "peak_bytes" in row:
                edge = spawn([name, cache_dir, "0", "1"], child_env(PYTHONPATH=str(ROOT)))
                row.update(edge if "error" not in edge else {"edge_error": edge["error"]})
        record["rows"][name] = row
        print(name, json.dumps(row), flush=True)
        record["seconds"] = time.time() - started
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.tag}.json").write_text(json.dumps(record, indent=1))
    print("\n".join(table(record)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, cache_dir, repeats, edge = sys.argv[2:6]
        print(json.dumps(measure(name, cache_dir, int(repeats), edge == "1")))
        raise SystemExit(0)
    raise SystemExit(main())
