"""The offloading executor: training under OffloadHooks equals plain training, and the hooks
really move the saved tensors (host to host on CPU, through pinned memory on CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_remat.runtime.offload import OffloadedModule, OffloadHooks, pinned_block_bytes

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
    hooks = OffloadHooks(min_bytes=1024)

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
    # Each save came back once per step: prefetched, on demand, or still held.
    served = (stats.served_from_prefetch + stats.fetched_on_demand
              + stats.served_before_offload_done)
    assert served == stats.offloaded_tensors + stats.shared_saves
    if device == "cpu":
        assert stats.served_from_prefetch > 0  # the backward found them brought back ahead
        assert stats.fetched_on_demand <= 4  # the first unpack of each step, at most


def test_saved_tensors_really_leave_the_graph():
    """What autograd gives back is the hooks' copy, not the original buffer, with the same
    values (without the hooks it is the original buffer)."""
    x = torch.randn(64, 64, requires_grad=True)
    z = x * 2
    assert z.sin().grad_fn._saved_self.data_ptr() == z.data_ptr()  # plain: the same buffer
    hooks = OffloadHooks(min_bytes=0, prefetch_bytes=0)
    with hooks:
        y = z.sin()  # sin saves its input
    unpacked = y.grad_fn._saved_self
    assert unpacked.data_ptr() != z.data_ptr()
    torch.testing.assert_close(unpacked, z.detach(), rtol=0, atol=0)
    assert hooks.stats.offloaded_tensors == 1
    assert hooks.stats.offloaded_bytes == 64 * 64 * 4
    assert hooks.stats.fetched_on_demand == 1  # prefetch_bytes=0: everything on demand
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
    with pytest.raises(ValueError, match="prefetch_bytes"):
        OffloadHooks(prefetch_bytes=-2)


def test_bandwidth_is_measured_once_per_device():
    from lightning_remat.runtime.offload import measure_bandwidth

    first = measure_bandwidth("cpu", nbytes=2**20, repeats=2)
    assert first > 0
    assert measure_bandwidth("cpu", nbytes=2**20) == first  # cached
    with pytest.raises(ValueError, match="must be positive"):
        measure_bandwidth("cpu", nbytes=0, refresh=True)


# ---- the executor on the device layer's CPU stand-in (copies complete late) --------------------
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402

from lightning_remat.streams import SimulatedStreams  # noqa: E402


class Chain(nn.Module):
    """Linear + Tanh layers of distinct widths, so each saved storage has its own size."""

    def __init__(self, widths=(48, 40, 56, 36, 60, 44)) -> None:
        super().__init__()
        pairs = zip((32,) + widths[:-1], widths)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in pairs)
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: torch.Tensor, hooks: OffloadHooks | None = None) -> torch.Tensor:
        h = x
        with hooks if hooks is not None else torch.enable_grad():
            for layer in self.layers:
                h = layer(h)
        return self.head(h)


def _chain_and_batches(steps: int = 3):
    torch.manual_seed(0)
    return Chain(), [(torch.randn(64, 32), torch.randint(0, 10, (64,))) for _ in range(steps)]


def test_copies_that_complete_late_still_give_plain_gradients_because_the_compute_waits():
    """The stand-in's copies complete only when the compute stream waits for them, and a
    fetched tensor reads NaN until then: equal gradients show every use waited."""
    model, batches = _chain_and_batches()
    twin = copy.deepcopy(model)
    streams = SimulatedStreams(latency=None)
    hooks = OffloadHooks(min_bytes=0, streams=streams)
    plain = train(model, batches, None, steps=3)
    offloaded = train(twin, batches, hooks, steps=3)
    for a, b in zip(plain, offloaded):
        for ga, gb in zip(a, b):
            torch.testing.assert_close(gb, ga, rtol=0, atol=1e-6)
    assert ("wait", 64 * 48 * 4) in streams.log  # the compute stream waited for a copy


def test_offloaded_activations_are_gone_from_the_device_when_the_stage_ends():
    model, batches = _chain_and_batches(1)
    streams = SimulatedStreams(latency=None)  # no copy completes on its own
    hooks = OffloadHooks(min_bytes=0, streams=streams, max_in_flight_bytes=2 * 64 * 60 * 4)
    activations: list[StorageWeakRef] = []
    for layer in model.layers[:-1]:
        layer[1].register_forward_hook(lambda m, i, out: activations.append(StorageWeakRef(out.untyped_storage())))
    x, target = batches[0]
    loss = nn.functional.cross_entropy(model(x, hooks), target)
    # After the stage: every offloaded storage left the device (only the stage's output,
    # which the head still uses, is alive), though the host queue was never drained by a sync.
    assert activations and all(ref.expired() for ref in activations)
    assert hooks.stats.compute_waits >= hooks.stats.offloaded_tensors - hooks.stats.released_early
    # The bound held during the stage: at most the bound plus the copy that crossed it.
    assert streams.max_bytes_in_flight <= 2 * 64 * 60 * 4 + 64 * 60 * 4
    loss.backward()


def test_prefetch_follows_the_save_order_within_its_byte_window():
    model, batches = _chain_and_batches(1)
    streams = SimulatedStreams(latency=None)
    window = 64 * 60 * 4 + 64 * 56 * 4
    hooks = OffloadHooks(min_bytes=0, streams=streams, prefetch_bytes=window)
    x, target = batches[0]
    nn.functional.cross_entropy(model(x, hooks), target).backward()
    saved = [n for kind, n in streams.log if kind == "to_host"]
    fetched = [n for kind, n in streams.log if kind == "to_device"]
    assert fetched == saved[::-1]  # each once, in reverse save order
    assert hooks.stats.fetched_on_demand == 1 and hooks.stats.prefetched == len(saved) - 1
    # Fetched and not yet waited for: never more than the window (plus the one on demand).
    assert streams.max_bytes_in_flight <= max(sum(saved[:1]), window) + max(saved)


class SavesUnused(torch.autograd.Function):
    """Saves its input and never reads it in the backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_tensors_the_backward_never_unpacks_do_not_block_the_prefetch():
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    hooks = OffloadHooks(min_bytes=0, streams=SimulatedStreams(latency=0), prefetch_bytes=2 * 64 * 64 * 4)
    with hooks:
        h = x * 1.0
        for _ in range(6):
            h = SavesUnused.apply(torch.tanh(h))
    h.sum().backward()
    stats = hooks.stats
    assert stats.fetched_on_demand == 1  # the first unpack only, then prefetched
    assert stats.served_from_prefetch == stats.offloaded_tensors + stats.shared_saves - 1 - 6


class SavesForInspection(torch.autograd.Function):
    """Saves its input; the backward records the stride it got back."""

    strides: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        SavesForInspection.strides.append((saved.stride(), saved.is_contiguous()))
        return grad.expand_as(saved) * saved


@pytest.mark.parametrize("make", [
    lambda x: (torch.randn(2, 8, 6, 6) * x).contiguous(memory_format=torch.channels_last),
    lambda x: (torch.randn(32, 24) * x).t(),
    lambda x: (torch.randn(1, 40) * x).expand(50, 40),
], ids=["channels_last", "transposed", "expanded"])
def test_host_copies_keep_strides_and_expanded_tensors_stay_small(make):
    x = torch.tensor(1.0, requires_grad=True)
    saved = make(x)
    SavesForInspection.strides = []
    hooks = OffloadHooks(min_bytes=0)
    with hooks:
        y = SavesForInspection.apply(saved)
    y.backward()
    assert SavesForInspection.strides == [(saved.stride(), saved.is_contiguous())]
    assert hooks.stats.offloaded_bytes == saved.untyped_storage().nbytes()  # not the expanded size


def test_a_storage_saved_by_several_ops_is_copied_once_and_the_inputs_stay():
    torch.manual_seed(0)
    q, k, v = (nn.Linear(64, 64) for _ in range(3))
    x = torch.randn(128, 64)
    hooks = OffloadHooks(min_bytes=0)
    hooks.keep_resident([x])
    with hooks:
        inner = nn.functional.linear(x, q.weight)  # saves x: the step's input stays
        h = torch.relu(inner)
        out = q(h) + k(h) + v(h)  # three saves of h
    out.sum().backward()
    stats = hooks.stats
    assert stats.skipped_resident == 1
    # relu saves its output h, then q, k and v save h: one copy, three shared saves.
    assert stats.offloaded_tensors == 1 and stats.shared_saves == 3
    assert stats.offloaded_bytes == 128 * 64 * 4


def test_one_pinned_area_sized_from_the_plan_is_reused_every_step():
    model, batches = _chain_and_batches(4)
    streams = SimulatedStreams(latency=0)
    hooks = OffloadHooks(min_bytes=0, streams=streams)
    step_bytes = 64 * 4 * (32 + 48 + 40 + 56 + 36 + 60 + 48 + 40 + 56 + 36 + 60)
    hooks.reserve(step_bytes + 4096)
    train(model, batches, hooks, steps=4)
    # One area, never grown; the allocator's power-of-two block, which the area uses whole.
    assert streams.pinned_allocations == [pinned_block_bytes(step_bytes + 4096)]
    assert hooks.stats.pinned_bytes == pinned_block_bytes(step_bytes + 4096)


def test_without_a_plan_the_area_is_sized_once_to_the_first_step():
    model, batches = _chain_and_batches(4)
    streams = SimulatedStreams(latency=0)
    hooks = OffloadHooks(min_bytes=0, streams=streams)
    train(model, batches, hooks, steps=4)
    first_step = streams.pinned_requests[:-1]
    area = streams.pinned_requests[-1]
    assert area == pinned_block_bytes(area)  # the whole rounded block
    assert area == pinned_block_bytes(sum(-(-n // 512) * 512 for n in first_step))
    assert len(streams.pinned_allocations) == len(first_step) + 1  # then reused, steps 3 and 4 too
    # The first step's buffers, freed, stay in the allocator's cache beside the area: counted.
    assert hooks.stats.pinned_bytes == sum(streams.pinned_allocations)


def test_a_remat_module_never_offloads_its_inputs_parameters_or_buffers():
    from tests.test_apply import ResidualCNN, rematerialize, segments_plan

    torch.manual_seed(0)
    x = torch.randn(8, 3, 48, 48)
    remat_model = rematerialize(ResidualCNN(), (x,), plan_fn=lambda g: segments_plan(g, 2, ["offload", "keep"]))
    remat_model(x).sum().backward()
    executor = remat_model._remat_offload_factory.hooks
    assert executor.stats.skipped_resident >= 1  # the first conv saved the batch: it stayed
    assert executor.stats.offloaded_tensors > 0


def test_the_plan_sizes_the_pinned_area_and_the_prefetch_window():
    from types import SimpleNamespace

    from lightning_remat.runtime.offload import plan_offload_bytes
    from lightning_remat.solvers.plan import Stage

    graph = SimpleNamespace(nodes=[SimpleNamespace(id=n, saved=s) for n, s in
                                   (("a", 100), ("b", 200), ("c", 400), ("d", 800), ("e", 50))])
    plan = SimpleNamespace(stages=[Stage(["a", "b"], "offload"), Stage(["c"], "recompute"),
                                   Stage(["d"], "offload"), Stage(["e"], "keep")])
    assert plan_offload_bytes(graph, plan) == (1100, 800)
    assert plan_offload_bytes(None, plan) == (0, 0)

    model, batches = _chain_and_batches(1)
    streams = SimulatedStreams(latency=None)
    hooks = OffloadHooks(min_bytes=0, streams=streams)
    window = 64 * 60 * 4 + 64 * 44 * 4  # the two storages the backward needs first
    hooks.reserve(10**6, window)
    x, target = batches[0]
    nn.functional.cross_entropy(model(x, hooks), target).backward()
    fetched = [n for kind, n in streams.log if kind == "to_device"]
    assert streams.pinned_allocations == [pinned_block_bytes(10**6)] == [2**20]
    assert hooks.stats.fetched_on_demand == 1 and len(fetched) == hooks.stats.offloaded_tensors


def test_the_pinned_allocators_blocks_are_powers_of_two():
    assert [pinned_block_bytes(n) for n in (0, 1, 512, 513, 3 * 2**20)] == [0, 1, 512, 1024, 4 * 2**20]
    streams = SimulatedStreams()
    buffer = streams.pinned_empty(3000)
    assert buffer.numel() == 3000 and streams.pinned_allocations == [4096]


def test_sharded_parameters_reach_the_offload_executor(tmp_path):
    """torch FSDP2's parameters are DTensors, which have no storage of their own: the
    executor keeps their local shards resident (one gloo rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        # On the host: without a mesh, fully_shard moves the model and its inputs to a
        # CUDA device where one is present, and the input kept resident is not what it saves.
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        x = torch.randn(256, 64)
        expected = model(x).sum()
        expected.backward()
        grads = [p.grad.full_tensor().clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        hooks = OffloadHooks(min_bytes=0)
        hooks.keep_resident([*model.parameters(), x])
        with hooks:
            out = model(x).sum()
        out.backward()
        assert hooks.stats.offloaded_tensors > 0 and hooks.stats.skipped_resident >= 1
        assert torch.equal(out, expected)
        for p, g in zip(model.parameters(), grads):
            assert torch.equal(p.grad.full_tensor(), g)
    finally:
        dist.destroy_process_group()
