"""Training under a plan is plain training to the bit, on Hugging Face decoders with the
configs they ship (the cache on, sdpa attention, dropout as set): the loss and every
gradient of every step ``torch.equal`` to plain PyTorch's through ``remat()``, and to plain
Lightning's through ``Trainer(strategy=RematStrategy(...))``.

The first tests' batches have no attention mask, as a causal LM is trained on unpadded
sequences (the last gives masks, padding no token and padding some): plain
training then passes no mask to sdpa (``is_causal``) and, for a grouped-query decoder, lets
sdpa repeat the keys and values (``enable_gqa``). A capture that took the branches
``torch.export`` makes the model take (a materialised causal mask, keys and values repeated
by ``repeat_kv``) computed the same values with other ops, whose gradients differed in the
last bits (2 of 21 to 39 tensors equal on the Llama below; docs/design.md section 3,
"Plain's ops"). 128 tokens: at 32, both sets of ops happened to round alike. A plan whose
stages run ops out of the forward's order is the other case (section 5, "Plain's order"):
Chen's segments never do, and the policy takes a plan in the forward's order wherever one
fits the budget, as one does at 50% here.

Dropout draws from one generator state in both runs (``torch.manual_seed`` before each step,
``seed_everything`` before each fit).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_remat import remat
from tests.hf_architectures import VOCAB, build, one_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")

LENGTH = 128


def decoder(model_type: str) -> nn.Module:
    """A random-init causal LM of ``model_type`` at the architecture tests' sizes, its
    config's defaults otherwise (:func:`tests.hf_architectures.build`)."""
    return build(model_type)[0]


def ids(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))


def differing(a: nn.Module, b: nn.Module) -> list[str]:
    """The parameters whose gradients are not bit-equal, with the largest difference."""
    out = []
    for (key, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.equal(p.grad, q.grad)):
            apart = float((p.grad - q.grad).abs().max()) if p.grad is not None and q.grad is not None else None
            out.append(f"{key} ({apart})")
    return out


@pytest.mark.parametrize("budget, solver", [(None, "auto"), ("100%", "chen")], ids=["no-budget", "chen"])
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_remat_trains_a_decoder_with_its_default_config_to_the_bit_of_plain(
        model_type: str, budget: str | None, solver: str) -> None:
    torch.manual_seed(0)
    model = decoder(model_type).train()
    plain = copy.deepcopy(model)
    batch = {"input_ids": ids(), "labels": ids()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache notice
        planned = remat(model, batch, budget, solver=solver, loss_fn=lambda out: out.loss)
    assert planned.plan.notes[0].startswith("capture: torch.export"), planned.plan.notes[0]
    assert "branches it takes under torch.export" not in planned.plan.notes[0]
    if budget is not None:
        assert planned.plan.count("recompute") >= 3, planned.plan.stages
    assert not [n for n in planned.plan.notes if n.startswith("order:")]  # Chen's segments: prefixes
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(2):
        losses = []
        for module, optimizer in ((planned, optimizers[0]), (plain, optimizers[1])):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)
            loss = module(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        assert not differing(model, plain), (step, differing(model, plain))
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_the_strategy_trains_a_decoder_with_its_default_config_to_the_bit_of_plain_lightning(
        model_type: str, tmp_path: Any) -> None:
    """The job most users have: a LightningModule whose forward returns the decoder's loss,
    AdamW (whose first steps scale a gradient's last bits up to the learning rate), three
    steps under ``RematStrategy(memory_budget="50%")`` against plain Lightning's."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_remat.lightning.strategy import RematStrategy

    class Decoder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = decoder(model_type)
            self.gradients: list[dict[str, torch.Tensor]] = []
            self.losses: list[torch.Tensor] = []

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids, labels=input_ids).loss

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self(batch[0])
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.gradients.append({k: p.grad.clone() for k, p in self.named_parameters() if p.grad is not None})

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = TensorDataset(torch.cat([ids(seed=s) for s in range(3)]))
    trained = {}
    for name, strategy in (("plain", "auto"), ("remat", RematStrategy(memory_budget="50%"))):
        pl.seed_everything(0, verbose=False)
        module = Decoder()
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir=str(tmp_path / name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the cache notice, Lightning's hints
            trainer.fit(module, DataLoader(data, batch_size=2))
        trained[name] = module
        if name == "remat":
            (entry,) = strategy.planner.planned.values()
            assert entry.plan.notes[0].startswith("capture: torch.export"), entry.plan.notes[0]
            assert entry.plan.count("recompute") > 0, entry.plan.stages
            # A plan whose stages leave the forward's order can sum a gradient otherwise
            # (design.md section 5, "Plain's order"); the policy keeps the order where a plan
            # in it fits, as at 50% here.
            assert not [n for n in entry.plan.notes if n.startswith("order:")], entry.plan.notes
    plain, planned = trained["plain"], trained["remat"]
    assert len(planned.gradients) == len(plain.gradients) == 3
    for step, (got, expected) in enumerate(zip(planned.gradients, plain.gradients)):
        assert torch.equal(planned.losses[step], plain.losses[step]), step
        assert got.keys() == expected.keys()
        apart = {k: float((got[k] - expected[k]).abs().max()) for k in expected if not torch.equal(got[k], expected[k])}
        assert not apart, (step, apart)
    for (key, p), (_, q) in zip(planned.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), key


def test_attention_masks_are_taken_as_plain_training_takes_them() -> None:
    """A batch with an attention mask that pads no token (packed sequences, or a batch of one
    length): plain training reads its values and skips it for sdpa's ``is_causal``, so the
    capture skips it too, and a later batch whose mask pads tokens is captured and planned
    on its own, its mask applied. Every step to the bit of plain, alternating the two."""
    torch.manual_seed(0)
    model = decoder("llama").train()
    plain = copy.deepcopy(model)
    unpadded = torch.ones(2, LENGTH, dtype=torch.long)
    padded = unpadded.clone()
    padded[1, LENGTH // 2:] = 0
    batches = [{"input_ids": ids(seed=s), "labels": ids(seed=s), "attention_mask": mask}
               for s, mask in enumerate((unpadded, padded, unpadded))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache notice, the re-planning notice
        planned = remat(model, batches[0], "100%", solver="chen", loss_fn=lambda out: out.loss)
        for step, batch in enumerate(batches):
            for module in (planned, plain):
                torch.manual_seed(100 + step)
                module(**batch).loss.backward()
            assert not differing(model, plain), (step, differing(model, plain))
            model.zero_grad(set_to_none=True), plain.zero_grad(set_to_none=True)
    masks = sorted(leaf[1] for key in planned.variants for leaf in key
                   if isinstance(leaf, tuple) and leaf[:1] == ("unpadded attention masks",))
    assert masks == [(), ((2, LENGTH),)], masks  # one plan per kind of mask
