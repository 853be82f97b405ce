"""A LightningModule around any ``nn.Module`` on random inputs (``lightning-remat tune``)."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["SyntheticTask"]


class SyntheticTask(pl.LightningModule):
    """A LightningModule around any ``nn.Module`` on random inputs, for measuring memory
    (``lightning-remat tune``): the loss is the mean square of every floating output, so
    the backward runs through the whole model whatever its head."""

    def __init__(self, model: nn.Module, sample_shape: tuple[int, ...], batch_size: int = 2,
                 dtype: str = "float", vocab: int = 1000) -> None:
        super().__init__()
        self.model = model
        self.sample_shape = tuple(sample_shape)
        self.batch_size = batch_size
        self.dtype_name = dtype
        self.vocab = vocab

    def forward(self, x: torch.Tensor) -> Any:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # The floating leaves of the output, gathered without a recursive closure: one
        # would be a reference cycle holding the outputs until the garbage collector runs,
        # past the start of the backward, where the plan counts them freed.
        outputs = [t for t in pytree.tree_leaves(self(batch))
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not outputs:
            raise ValueError("the model returned no floating-point tensor to take a loss from")
        loss = outputs[0].float().pow(2).mean()
        for o in outputs[1:]:
            loss = loss + o.float().pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        shape, vocab, is_long = self.sample_shape, self.vocab, self.dtype_name == "long"

        class Random(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return 1 << 16

            def __getitem__(self, index: int) -> torch.Tensor:
                g = torch.Generator().manual_seed(index)
                if is_long:
                    return torch.randint(0, vocab, shape, generator=g)
                return torch.randn(*shape, generator=g)

        return torch.utils.data.DataLoader(Random(), batch_size=self.batch_size)
