"""The module ``remat`` returns keeps the original's interface: a container's indexing,
length and iteration, the original's attributes and methods, and the container types of
its output (an ``OrderedDict`` stays one), for a model fx traces and for one it cannot."""

from __future__ import annotations

import collections
import copy
import io
from typing import NamedTuple

import pytest
import torch
from torch import nn

from lightning_remat import remat
from lightning_remat.runtime.module import RematModule


def stack(width: int = 16, depth: int = 3) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())])


class Classifier(nn.Module):
    """Custom attributes and methods besides forward."""

    def __init__(self, width: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.temperature = 2.0
        self.body = stack(width)
        self.head = nn.Linear(width, num_classes)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encode(x)) / self.temperature


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Structured(nn.Module):
    """An OrderedDict (keys out of sorted order) holding a list and a named tuple."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.body = stack(width, depth=8)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> collections.OrderedDict:
        h = self.body(x)
        return collections.OrderedDict([("logits", self.head(h)), ("hidden", [h, h * 2]),
                                        ("pair", Pair(h + 1, h - 1))])


class Untraceable(Structured):
    """The same, with data-dependent control flow fx cannot trace."""

    def forward(self, x: torch.Tensor) -> collections.OrderedDict:
        h = self.body(x)
        if h.sum() > 1e9:
            h = h * 0
        return collections.OrderedDict([("logits", self.head(h)), ("hidden", [h, h * 2])])


def test_a_sequential_indexes_measures_and_iterates_like_the_original() -> None:
    model = stack()
    r = remat(model, torch.randn(4, 16))
    assert r[0] is model[0] and r[-1] is model[-1]
    assert isinstance(r[1:3], nn.Sequential) and list(r[1:3]) == list(model[1:3])
    assert len(r) == len(model) == 6
    assert list(iter(r)) == list(model)
    assert model[2] in r
    assert bool(r)


def test_attributes_and_methods_reach_the_original() -> None:
    torch.manual_seed(0)
    model = Classifier()
    x = torch.randn(4, 16)
    r = remat(model, x)
    assert r.num_classes == 4 and r.temperature == 2.0
    assert torch.equal(r.encode(x), model.encode(x))
    model.num_classes = 7  # read through, not copied
    assert r.num_classes == 7
    assert "encode" in dir(r)
    with pytest.raises(AttributeError, match="no attribute 'missing'.*Classifier"):
        _ = r.missing
    with pytest.raises(TypeError, match="not subscriptable"):
        r[0]
    with pytest.raises(TypeError, match="not sized"):
        len(r)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize(("model_type", "budget"), [(Structured, "80%"), (Untraceable, None)])
def test_output_containers_are_kept(model_type: type[nn.Module], budget: str | None) -> None:
    torch.manual_seed(0)
    model = model_type()
    x = torch.randn(256, 16)
    want = model(x)
    r = remat(model, x, memory_budget=budget)
    if budget is not None:
        assert any(s.action == "recompute" for s in r.plan.stages)
    got = r(x)
    assert type(got) is collections.OrderedDict
    assert list(got) == list(want)
    assert type(got["hidden"]) is list
    if "pair" in want:
        assert type(got["pair"]) is Pair
    assert torch.allclose(got["logits"], want["logits"])
    # The container types survive pickling and copying.
    loaded = torch.load(io.BytesIO(_saved(r)), weights_only=False)
    assert type(loaded(x)) is collections.OrderedDict
    assert type(copy.deepcopy(r)(x)) is collections.OrderedDict


def _saved(module: nn.Module) -> bytes:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    return buffer.getvalue()


def test_pickled_and_copied_modules_keep_the_interface() -> None:
    model = Classifier()
    x = torch.randn(4, 16)
    r = remat(model, x)
    for other in (torch.load(io.BytesIO(_saved(r)), weights_only=False), copy.deepcopy(r)):
        assert isinstance(other, RematModule)
        assert other.num_classes == 4
        assert other.body is other.original.body  # the copy's members are its original's
        assert torch.allclose(other(x), r(x))
        assert torch.allclose(other.encode(x), model.encode(x))
