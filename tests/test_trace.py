import pytest
import torch
from torch import nn

from lightning_remat.errors import TraceError
from lightning_remat.graph.trace import trace_module
from tests import models


def _linear_bytes(fan_in: int, fan_out: int) -> int:
    return (fan_in * fan_out + fan_out) * 4


def test_linear_model_is_a_chain_of_its_layers():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    traced = trace_module(model, torch.randn(3, 8))
    graph = traced.graph
    assert traced.kind == "fx"
    assert [(n.id, n.op) for n in graph] == [("_0", "Linear"), ("_1", "ReLU"), ("_2", "Linear")]
    assert graph.edges == [("_0", "_1"), ("_1", "_2")]
    assert graph.is_chain()
    # vertex ids are the fx node names, so plans map back onto the traced module
    fx_names = {n.name for n in traced.gm.graph.nodes}
    assert set(graph.ids) <= fx_names
    assert graph.meta.input_consumers == ["_0"]
    assert graph.meta.outputs == ["_2"]
    assert graph.meta.param_bytes == {"_0": _linear_bytes(8, 16), "_2": _linear_bytes(16, 4)}
    assert all(n.mem == 0 and n.t_fwd == 0 for n in graph)


def test_residual_add_and_functional_ops_are_vertices():
    graph = trace_module(models.residual_cnn(), torch.randn(2, 3, 8, 8)).graph
    ops = {n.id: n.op for n in graph}
    assert ops["add"] == "add" and ops["relu_1"] == "relu" and ops["flatten"] == "flatten"
    # the residual: add reads both the block's output and its input
    assert graph.predecessors("add") == ["relu", "bn2"]
    assert set(graph.successors("relu")) == {"conv2", "add"}
    assert graph.predecessors("fc") == ["flatten"]
    assert not graph.is_chain()
    assert graph.meta.outputs == ["fc"]


def test_concat_joins_two_branches():
    graph = trace_module(models.concat_branches(), torch.randn(3, 8)).graph
    assert graph.predecessors("cat") == ["relu", "tanh"]
    assert graph.predecessors("relu") == ["left"] and graph.predecessors("tanh") == ["right"]
    assert sorted(graph.meta.input_consumers) == ["left", "right"]
    assert graph.successors("cat") == ["head"]


class ViewBySize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 4 * 4, 2)

    def forward(self, x):
        h = self.conv(x)
        return self.fc(h.view(h.size(0), -1))


def test_edges_pass_through_non_tensor_nodes():
    traced = trace_module(ViewBySize(), torch.randn(2, 3, 6, 6))
    graph = traced.graph
    assert "size" in {n.name for n in traced.gm.graph.nodes}
    assert "size" not in graph  # an int, not a tensor
    assert graph.ids == ["conv", "view", "fc"]
    assert graph.edges == [("conv", "view"), ("view", "fc")]


class Chunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=1)
        return torch.relu(a) * b


def test_tuple_outputs_become_their_getitem_vertices():
    traced = trace_module(Chunked(), torch.randn(2, 4))
    graph = traced.graph
    assert "chunk" not in graph
    first, second = (n.id for n in graph if n.op == "getitem")
    assert traced.charge["chunk"] == first  # the op's cost goes to its first element
    assert graph.predecessors(first) == ["proj"]
    assert graph.predecessors(second) == [first]
    assert sorted(graph.predecessors("mul")) == sorted(["relu", second])


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        h = self.fc(x)
        if mask is not None:
            h = h * mask
        return h


def test_keyword_inputs_and_defaults():
    x = torch.randn(2, 4)
    plain = trace_module(OptionalMask(), x)
    assert plain.graph.ids == ["fc"]
    masked = trace_module(OptionalMask(), x, {"mask": torch.ones(2, 4)})
    assert masked.graph.ids == ["fc", "mul"]
    assert masked.graph.meta.input_consumers == ["fc", "mul"]


class DataDependent(nn.Module):
    """Python control flow on a tensor value: fx rejects it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.ReLU()
        self.c = nn.Linear(8, 2)

    def forward(self, x):
        if x.abs().sum() >= 0:  # always true; fx cannot branch on a traced value
            x = self.a(x)
        return self.c(self.b(x))


class Tangled(nn.Module):
    """Data-dependent, and no submodule it calls once: nothing to checkpoint in place."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        if x.sum() > 0:
            return x @ self.w
        return x @ self.w.t()


def test_fallback_runs_the_models_own_forward_and_warns_why():
    with pytest.warns(UserWarning, match=r"could not trace DataDependent .*control flow.*its own forward runs"):
        traced = trace_module(DataDependent(), torch.randn(3, 4))
    assert traced.kind == "children" and traced.gm is None
    assert [name for name, _ in traced.children] == ["a", "b", "c"]
    graph = traced.graph
    assert [(n.id, n.op) for n in graph] == [("a", "Linear"), ("b", "ReLU"), ("c", "Linear")]
    assert graph.edges == [("a", "b"), ("b", "c")]
    assert graph.meta.param_bytes == {"a": _linear_bytes(4, 8), "c": _linear_bytes(8, 2)}
    assert graph.meta.outputs == ["c"] and graph.meta.input_consumers == ["a"]


def test_trace_error_names_the_module_when_nothing_works():
    with pytest.raises(TraceError, match=r"Tangled.*torch\.fx rejected.*control flow.*cannot be checkpointed in place"):
        trace_module(Tangled(), torch.randn(3, 4))


def test_tracing_leaves_buffers_modes_and_rng_alone():
    model = models.residual_cnn()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(3)
    trace_module(model, torch.randn(4, 3, 8, 8))
    after_trace = torch.rand(5)
    torch.manual_seed(3)
    torch.randn(4, 3, 8, 8)
    assert torch.equal(after_trace, torch.rand(5))
    assert model.training and model.bn1.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_transformer_lm_traces_attention_ops():
    graph = trace_module(models.tiny_lm(), torch.randint(0, 50, (2, 10))).graph
    ops = [n.op for n in graph]
    assert ops.count("scaled_dot_product_attention") == 2
    assert graph.meta.outputs == ["head"]
    # the positional-embedding slice reads a parameter only: its bytes are owned there
    assert graph.meta.param_bytes["getitem"] == 32 * 16 * 4


def test_trace_rejects_a_non_module():
    with pytest.raises(TypeError, match="nn.Module"):
        trace_module(lambda x: x, torch.randn(2))  # type: ignore[arg-type]


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 6, batch_first=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.fc(out[:, -1] + h[-1] + c[-1])


def test_nested_tuple_outputs_hang_off_the_op_owner():
    traced = trace_module(Recurrent(), torch.randn(2, 5, 4))
    graph = traced.graph
    owner = traced.charge["lstm"]
    assert "lstm" not in graph and owner in graph
    assert graph.meta.input_consumers == [owner]
    assert graph.predecessors(owner) == []
    assert graph.meta.param_bytes == {
        owner: sum(p.numel() * 4 for p in traced.gm.lstm.parameters()),
        "fc": (6 * 3 + 3) * 4,
    }
    # every other vertex descends from the vertex that carries the LSTM's cost
    reach = {owner}
    for vid in graph.ids:
        if any(p in reach for p in graph.predecessors(vid)):
            reach.add(vid)
    assert reach == set(graph.ids)


class ReshapeByOtherSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)

    def forward(self, x):
        ha, hb = self.a(x), self.b(x)
        return hb.view(ha.size(0), 2, 3)  # reads ha only for its size


def test_edges_that_carry_only_sizes_are_marked():
    graph = trace_module(ReshapeByOtherSize(), torch.randn(2, 4)).graph
    assert sorted(graph.predecessors("view")) == ["a", "b"]
    assert graph.meta.shape_edges == [["a", "view"]]
    assert trace_module(ViewBySize(), torch.randn(2, 3, 6, 6)).graph.meta.shape_edges == []


class DropPathBlock(nn.Module):
    """timm's ``drop_path`` as it is written: the mask scaled in place by a statement whose
    result nothing reads, then multiplied in."""

    def __init__(self, width: int = 64, keep: float = 0.7) -> None:
        super().__init__()
        self.fc1, self.fc2, self.keep = nn.Linear(width, width), nn.Linear(width, width), keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        mask = h.new_empty((h.shape[0], 1)).bernoulli_(self.keep)
        mask.div_(self.keep)
        return self.fc2(x + h * mask)


def test_a_reader_after_an_unused_inplace_statement_reads_its_result() -> None:
    """The multiply reads the mask after ``div_`` scaled it: the vertex graph has the edge
    from the division to the multiply, so no plan can run them in the other order; and a
    plan that recomputes the block trains as plain does."""
    from lightning_remat import remat

    torch.manual_seed(0)
    model = nn.Sequential(DropPathBlock(), DropPathBlock(), DropPathBlock())
    x = torch.randn(512, 64)
    graph = trace_module(model, (x,)).graph
    divs = [v for v in graph.ids if graph[v].op in ("div_", "div")]
    assert divs and all(any(graph[w].op == "mul" for w in graph.successors(v)) for v in divs)

    import copy

    plain = copy.deepcopy(model)
    remat_model = remat(model, x, "75%")
    assert remat_model.plan.count("recompute") > 0
    for module in (plain, remat_model):
        torch.manual_seed(1)
        module(x).square().sum().backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)


class AugmentedBlock(nn.Module):
    """A ResNet's ``out += identity`` beside an ``int`` counted with ``+=`` and a name kept
    for the tensor before its write: eager Python writes the tensor in place (the name sees
    the write) and rebinds the int (its other name keeps the old value)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        n = x.size(0)
        count = n
        count += 1
        out = self.bn(self.conv(x))
        before = out
        out += x
        out = torch.relu_(out)
        return out * count + before * n


def test_augmented_assignment_writes_a_tensor_in_place_and_rebinds_an_int() -> None:
    """fx's proxies have no ``__iadd__``, so Python falls back to ``+`` and the trace would
    add into a new tensor where the forward wrote in place: the rematerialized forward
    allocated a buffer per residual that plain training does not, and a name held for the
    tensor before the write read it unwritten. The trace keeps the write in place on the
    tensor and the rebinding on the int, and the plan trains as plain does."""
    import copy
    import operator

    from lightning_remat import remat

    torch.manual_seed(0)
    model = nn.Sequential(*(AugmentedBlock() for _ in range(4)))
    x = torch.randn(8, 4, 16, 16)
    traced = trace_module(model, (x,))
    assert traced.kind == "fx"
    targets = {n.name: n.target for n in traced.gm.graph.nodes}
    writes = [name for name, target in targets.items() if target is operator.iadd]
    assert len(writes) == 4, targets  # the residuals; the int's += is an add again
    from lightning_remat.graph.ops import inplace_operands

    written = inplace_operands(traced.graph)
    assert all(traced.graph[written[v]].op == "BatchNorm2d" for v in writes), written
    with torch.no_grad():
        assert torch.equal(traced.gm(x.clone()), model(x.clone()))

    plain = copy.deepcopy(model)
    remat_model = remat(model, x, "75%")
    assert remat_model.plan.count("recompute") > 0
    for module in (plain, remat_model):
        module(x).square().sum().backward()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad)
    for p, q in zip(plain.buffers(), model.buffers()):
        assert torch.equal(p, q)
