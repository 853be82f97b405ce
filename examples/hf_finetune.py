"""Fine-tune a Hugging Face decoder in a LightningModule within half its step's memory.

A small Llama-family decoder from ``transformers`` (random init, no download), its config
as it ships (the cache on, sdpa attention), trained for a few steps twice from the same
seed: plainly and with ``RematStrategy(memory_budget="50%")``. Runs on the CPU in under a
minute and prints the plan, the measured peak of one step of each and how far the
weights are apart.

    python examples/hf_finetune.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_remat
from lightning_remat.budget import format_bytes
from lightning_remat.measure.peak import peak_bytes

try:
    import transformers
except ImportError:  # an extra: pip install -e ".[hf]"
    transformers = None

VOCAB, SEQUENCE, BATCH = 1000, 128, 8


class FineTune(pl.LightningModule):
    """A causal language model and its own loss (labels are the inputs, shifted inside)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE)
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def training_step(self, batch, batch_idx):
        loss = self(batch[0])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> DataLoader:
    ids = torch.randint(0, VOCAB, (4 * BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids), batch_size=BATCH)


def train(strategy, root: Path) -> FineTune:
    pl.seed_everything(0)
    model = FineTune()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False,
                         default_root_dir=str(root), enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, data())
    return model


def main() -> int:
    if transformers is None:
        print("this example needs transformers: pip install -e '.[hf]'", file=sys.stderr)
        return 1
    root = Path("lightning_logs") / "hf_finetune"
    print(f"lightning-remat {lightning_remat.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, CPU")
    plain = train("auto", root / "plain")
    strategy = lightning_remat.RematStrategy(memory_budget="50%")
    with warnings.catch_warnings():
        # Said once: the decoder's cache is off in the planned calls, as HF's checkpointing does.
        warnings.filterwarnings("ignore", message=".*cache of past keys and values.*")
        remat = train(strategy, root / "remat")

    (entry,) = strategy.planner.planned.values()
    ids = next(iter(data()))[0]
    plain.train(), remat.train()
    plain_peak = peak_bytes(lambda: plain(ids).backward())
    remat_peak = peak_bytes(lambda: entry.module(ids).backward())
    apart = max(float((a - b).detach().abs().max()) for a, b in zip(plain.parameters(), remat.parameters()))
    print()
    print(f"captured                         : {entry.plan.notes[0] if entry.plan.notes else ''}")
    print(f"plan                             : {entry.plan.solver}, {entry.plan.count('recompute')} "
          f"recomputed stages of {len(entry.plan.stages)}")
    print(f"measured peak of one step, plain : {format_bytes(plain_peak)}")
    print(f"measured peak of one step, remat : {format_bytes(remat_peak)} "
          f"(budget {format_bytes(entry.budget_bytes)}, predicted {format_bytes(entry.plan.predicted_peak_bytes)})")
    print(f"largest weight difference        : {apart:.2e}")
    return 0 if remat_peak < plain_peak else 1


if __name__ == "__main__":
    sys.exit(main())
