"""Small models shared by the tests (and usable as ``tests.models:factory`` in the CLI)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp(width: int = 16, depth: int = 2) -> nn.Sequential:
    """Linear/ReLU stack ending in a Linear: input (B, width)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, width))
    return nn.Sequential(*layers)


class ResidualCNN(nn.Module):
    """conv -> bn -> relu, a residual block (add), pooling, flatten, linear: input (B, 3, H, W)."""

    def __init__(self, channels: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(h))
        y = F.relu(y + h)
        return self.fc(torch.flatten(self.pool(y), 1))


def residual_cnn() -> ResidualCNN:
    return ResidualCNN()


class ConcatBranches(nn.Module):
    """Two branches from one input joined by torch.cat: input (B, width)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.left = nn.Linear(width, width)
        self.right = nn.Linear(width, width)
        self.head = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([torch.relu(self.left(x)), torch.tanh(self.right(x))], dim=1)
        return self.head(joined)


def concat_branches() -> ConcatBranches:
    return ConcatBranches()


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, written out so fx sees every op."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        batch, length, dim = h.shape
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        q = q.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
        k = k.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
        v = v.view(batch, length, self.heads, dim // self.heads).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(att.transpose(1, 2).reshape(batch, length, dim))
        return h + self.down(self.act(self.up(self.norm2(h))))


class TinyLM(nn.Module):
    """A causal transformer language model: input (B, T) token ids below ``vocab``."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 2, layers: int = 2,
                 max_len: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.size(1)
        h = self.embed(tokens) + self.pos[:, :length]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def tiny_lm() -> TinyLM:
    return TinyLM()
