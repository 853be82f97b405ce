"""The offloading executor: training under OffloadHooks equals plain training, and the hooks
really move the saved tensors (host to host on CPU, through pinned memory on CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_remat.runtime.offload import OffloadedModule, OffloadHooks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.front = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.ReLU())
        self.back = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor, hooks: OffloadHooks | None = None) -> torch.Tensor:
        if hooks is None:
            return self.back(self.front(x))
        with hooks:
            h = self.front(x)
        return self.back(h)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                   nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 8 * 8, 10))

    def forward(self, x: torch.Tensor, hooks: OffloadHooks | None = None) -> torch.Tensor:
        if hooks is None:
            return self.head(self.block(self.stem(x)))
        h = self.stem(x)
        with hooks:  # the middle of the network offloads, the ends do not
            h = self.block(h)
        return self.head(h)


def train(model: nn.Module, batches, hooks: OffloadHooks | None, steps: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    grads = []
    for step in range(steps):
        x, target = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x, hooks), target)
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
    return grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_training_under_offload_hooks_equals_plain(kind: str, device: str):
    torch.manual_seed(0)
    if kind == "mlp":
        model = MLP()
        batches = [(torch.randn(16, 32), torch.randint(0, 10, (16,))) for _ in range(3)]
    else:
        model = CNN()
        batches = [(torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))) for _ in range(3)]
    model = model.to(device)
    batches = [(x.to(device), t.to(device)) for x, t in batches]
    twin = copy.deepcopy(model)
    hooks = OffloadHooks(min_bytes=1024, prefetch=2)

    plain_grads = train(model, batches, None, steps=4)
    offload_grads = train(twin, batches, hooks, steps=4)

    for step, (a, b) in enumerate(zip(plain_grads, offload_grads)):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(gb, ga, rtol=0, atol=1e-6, msg=f"step {step}")
    for (name, pa), pb in zip(model.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(pb, pa, rtol=0, atol=1e-6, msg=name)  # BN statistics too
    stats = hooks.stats
    assert stats.offloaded_bytes > 0 and stats.offloaded_tensors > 0
    assert stats.skipped_parameters > 0  # weights are saved by Linear/Conv but never moved
    # Each offloaded tensor came back once per step: prefetched, on demand, or still held.
    served = (stats.served_from_prefetch + stats.fetched_on_demand
              + stats.served_before_offload_done)
    assert served == stats.offloaded_tensors
    if device == "cpu":
        assert stats.served_from_prefetch > 0  # the backward found them brought back ahead
        assert stats.fetched_on_demand <= 4  # the first unpack of each step, at most


def test_saved_tensors_really_leave_the_graph():
    """What autograd gives back is the hooks' copy, not the original buffer, with the same
    values (without the hooks it is the original buffer)."""
    x = torch.randn(64, 64, requires_grad=True)
    z = x * 2
    assert z.sin().grad_fn._saved_self.data_ptr() == z.data_ptr()  # plain: the same buffer
    hooks = OffloadHooks(min_bytes=0, prefetch=0)
    with hooks:
        y = z.sin()  # sin saves its input
    unpacked = y.grad_fn._saved_self
    assert unpacked.data_ptr() != z.data_ptr()
    torch.testing.assert_close(unpacked, z.detach(), rtol=0, atol=0)
    assert hooks.stats.offloaded_tensors == 1
    assert hooks.stats.offloaded_bytes == 64 * 64 * 4
    assert hooks.stats.fetched_on_demand == 1  # prefetch=0: everything on demand
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(z.detach()))


def test_small_tensors_and_parameters_stay():
    hooks = OffloadHooks(min_bytes=10**9)
    layer = nn.Linear(8, 8)
    with hooks:
        out = layer(torch.randn(4, 8, requires_grad=True)).relu()
    out.sum().backward()
    assert hooks.stats.offloaded_bytes == 0
    assert hooks.stats.skipped_small > 0 and hooks.stats.skipped_parameters > 0


def test_retain_graph_backward_twice():
    hooks = OffloadHooks(min_bytes=0)
    x = torch.randn(32, 32, requires_grad=True)
    with hooks:
        y = torch.tanh(x @ x).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_offloaded_module_wrapper_keeps_state_dict_keys():
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    wrapped = OffloadedModule(inner, OffloadHooks(min_bytes=0))
    assert list(wrapped.state_dict()) == [f"module.{k}" for k in inner.state_dict()]
    x = torch.randn(3, 4)
    wrapped(x).sum().backward()
    assert wrapped.hooks.stats.offloaded_tensors > 0


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="min_bytes"):
        OffloadHooks(min_bytes=-1)
    with pytest.raises(ValueError, match="prefetch"):
        OffloadHooks(prefetch=-2)


def test_bandwidth_is_measured_once_per_device():
    from lightning_remat.runtime.offload import measure_bandwidth

    first = measure_bandwidth("cpu", nbytes=2**20, repeats=2)
    assert first > 0
    assert measure_bandwidth("cpu", nbytes=2**20) == first  # cached
    with pytest.raises(ValueError, match="must be positive"):
        measure_bandwidth("cpu", nbytes=0, refresh=True)
