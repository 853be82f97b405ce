"""Models the benchmarks share.

``GPT``: a small GPT-style language model (token and position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, a final LayerNorm and a head tied to the
token embedding). Plain PyTorch ops only, so ``torch.fx`` traces it; ``GPT.sequential()``
is the same forward as a sequence of layers.

``UNet``: Ronneberger et al.'s U-Net (two 3x3 conv-BatchNorm-ReLU per level, max-pool down,
transposed-conv up, skip connections concatenated), sized by ``width`` and ``depth``: the
long skip connections make its graph far from a chain, so it has no sequential form.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, context: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.head_width = width // heads
        self.scale = 1.0 / math.sqrt(width // heads)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, context, context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, self.head_width).transpose(1, 2)
        k = k.view(b, t, self.heads, self.head_width).transpose(1, 2)
        v = v.view(b, t, self.heads, self.head_width).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~self.mask, float("-inf"))
        weights = F.softmax(scores, dim=-1)
        y = (weights @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, context)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token ids (batch, context) -> logits (batch, context, vocab)."""

    def __init__(self, vocab: int = 8192, width: int = 256, depth: int = 4, heads: int = 4,
                 context: int = 256) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(1, context, width))
        self.blocks = nn.Sequential(*[Block(width, heads, context) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        nn.init.normal_(self.positions, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # The sequence length is the context length (fx traces shapes as constants).
        x = self.tokens(idx) + self.positions
        x = self.blocks(x)
        return self.head(self.ln_f(x))

    def sequential(self) -> nn.Sequential:
        """The same forward as layers in a row (embeddings, blocks, final LayerNorm, head),
        sharing this model's parameters: the form ``checkpoint_sequential`` cuts."""
        return nn.Sequential(_Embeddings(self), *self.blocks, self.ln_f, self.head)


class _Embeddings(nn.Module):
    """A GPT's token and position embeddings as one layer (the GPT is held outside the
    module tree, so its parameters are not registered twice)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self._gpt = [gpt]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        gpt = self._gpt[0]
        return gpt.tokens(idx) + gpt.positions


class DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        )


class UNet(nn.Module):
    """Images (batch, in_channels, H, W) -> per-pixel logits (batch, classes, H, W); H and W
    divisible by 2**depth."""

    def __init__(self, in_channels: int = 3, classes: int = 2, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([DoubleConv(in_channels, widths[0])])
        self.down.extend(DoubleConv(widths[i], widths[i + 1]) for i in range(depth))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                for i in reversed(range(depth)))
        self.merge = nn.ModuleList(DoubleConv(2 * widths[i], widths[i]) for i in reversed(range(depth)))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        skips.pop()
        for up, merge in zip(self.up, self.merge):
            x = merge(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class WithLoss(nn.Module):
    """``model`` followed by its loss, so one traced graph holds the whole step's forward
    (the loss's own saved tensors, e.g. cross entropy's log-softmax, are then vertices)."""

    def __init__(self, model: nn.Module, sequence: bool = False) -> None:
        super().__init__()
        self.model = model
        self.sequence = sequence
        """Outputs are (batch, time, classes), targets (batch, time): a language model."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        if self.sequence:
            return lm_loss(out, targets)
        return F.cross_entropy(out, targets)
