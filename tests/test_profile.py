import warnings

import pytest
import torch
from torch import nn

from lightning_remat.cli import main
from lightning_remat.device import is_out_of_memory
from lightning_remat.graph import profile as profile_mod
from lightning_remat.graph.instruments import OpRecord
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.trace import trace_module
from tests import models

F32 = 4
TEMP_BYTES = 16 * 2**20


def plus_big_temporary(x):
    """An op that needs a 16 MiB scratch buffer it frees before returning."""
    scratch = torch.ones(TEMP_BYTES // F32)
    return x + scratch[:1].sum()


torch.fx.wrap("plus_big_temporary")


class WithScratch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return plus_big_temporary(self.fc(x))


def _fast(module, x, **kw):
    kw.setdefault("warmup", 0)
    kw.setdefault("repeats", 1)
    return profile_module(module, x, **kw)


def test_saved_bytes_of_relu_and_linear_match_hand_computed_sizes():
    batch = 4
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    graph = _fast(model, torch.randn(batch, 8))
    first, relu, second = graph.ids
    # mem is numel * element_size of each output
    assert [graph[i].mem for i in graph.ids] == [batch * 16 * F32, batch * 16 * F32, batch * 4 * F32]
    # ReLU keeps its output; Linear keeps its input (its weight is a parameter, not counted)
    assert graph[relu].saved == batch * 16 * F32
    assert graph[second].saved == batch * 16 * F32
    assert graph[first].saved == batch * 8 * F32
    refs = graph.meta.saved_refs
    assert refs[relu] == [relu] and refs[second] == [relu] and refs[first] == []
    # the first Linear saves the step's input, which is resident, not a vertex
    assert graph.meta.saved_input_bytes == {first: batch * 8 * F32}
    assert graph.meta.input_bytes == batch * 8 * F32
    assert graph.meta.batch_size == batch
    assert graph.meta.device == "cpu" and graph.meta.dtype == "float32"
    assert graph.meta.outputs == [second] and graph.meta.input_consumers == [first]


def test_saved_bytes_of_batchnorm_in_training():
    batch, channels, side = 2, 6, 5
    model = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
    model.train()
    graph = _fast(model, torch.randn(batch, 3, side, side))
    conv, bn, relu = graph.ids
    activation = batch * channels * side * side * F32
    assert graph[conv].mem == graph[bn].mem == graph[relu].mem == activation
    # input plus save_mean and save_invstd (C floats each); weight and running stats excluded
    assert graph[bn].saved == activation + 2 * channels * F32
    assert graph.meta.saved_refs[bn] == [conv]
    assert graph.meta.saved_refs[relu] == [relu]


def test_inplace_relu_is_an_alias_of_its_input():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 6, 6)
    normal = _fast(model, x)
    safe = _fast(model, x, safe=True)
    _, bn, relu, _ = normal.ids
    assert normal.meta.aliases == {relu: bn}
    # the in-place ReLU saves its result, which is the BatchNorm output's storage
    assert normal.meta.saved_refs[relu] == [bn]
    for graph in (normal, safe):
        assert graph[relu].saved == graph[bn].mem
    assert safe.meta.aliases == normal.meta.aliases
    assert safe.meta.saved_refs == normal.meta.saved_refs


@pytest.mark.parametrize(
    "factory, example",
    [
        (models.mlp, lambda: torch.randn(4, 16)),
        (models.residual_cnn, lambda: torch.randn(2, 3, 8, 8)),
        (models.concat_branches, lambda: torch.randn(3, 8)),
        (models.tiny_lm, lambda: torch.randint(0, 50, (2, 10))),
    ],
)
def test_safe_mode_measures_the_same_bytes(factory, example):
    torch.manual_seed(0)
    model, x = factory(), example()
    normal = _fast(model, x)
    safe = _fast(model, x, safe=True)
    assert normal.ids == safe.ids and normal.edges == safe.edges
    assert [n.mem for n in normal] == [n.mem for n in safe]
    assert [n.saved for n in normal] == [n.saved for n in safe]
    for key in ("saved_refs", "saved_input_bytes", "aliases", "batch_dependent", "param_bytes",
                "requires_grad", "resident_views"):
        assert getattr(normal.meta, key) == getattr(safe.meta, key), key
    assert normal.meta.plain_peak_bytes is not None and safe.meta.plain_peak_bytes is None
    assert safe.meta.safe is True and normal.meta.safe is False
    assert sum(n.saved for n in normal) > 0


def test_times_are_positive_medians():
    graph = profile_module(models.mlp(), torch.randn(8, 16), warmup=1, repeats=3)
    for node in graph:
        assert node.t_fwd > 0 and node.t_bwd > 0, node
    assert graph.meta.step_seconds > 0


def test_profiling_does_not_change_training():
    model = models.residual_cnn()
    x = torch.randn(4, 3, 8, 8)
    model(x).sum().backward()  # existing gradients must survive
    model.fc.weight.grad = None  # and a missing one must stay missing
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    grads = {k: None if v.grad is None else v.grad.clone() for k, v in model.named_parameters()}
    torch.manual_seed(7)
    _fast(model, x)
    _fast(model, x, safe=True)
    next_random = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(next_random, torch.rand(4))
    for k, v in model.named_parameters():
        assert torch.equal(v, params[k]), k
        if grads[k] is None:
            assert v.grad is None, k
        else:
            assert torch.equal(v.grad, grads[k]), k
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert model.training


def test_batch_dependence_separates_parameter_slices():
    graph = _fast(models.tiny_lm(), torch.randint(0, 50, (2, 10)))
    dependent = graph.meta.batch_dependent
    assert dependent["getitem"] is False  # self.pos[:, :T] does not grow with the batch
    assert dependent["head"] is True and dependent["embed"] is True
    assert "getitem" in graph.meta.resident_views  # a view of a parameter: no new memory
    # the scaled graph doubles the activations, not the parameter slice
    doubled = graph.scaled(4)
    assert doubled["head"].mem == 2 * graph["head"].mem
    assert doubled["getitem"].mem == graph["getitem"].mem


def test_views_are_recorded_as_aliases():
    graph = _fast(models.residual_cnn(), torch.randn(2, 3, 8, 8))
    assert graph.meta.aliases == {"flatten": "pool"}
    assert graph.meta.saved_refs["fc"] == ["pool"]  # the owner of flatten's storage


def test_plain_peak_is_measured_in_normal_mode():
    model = models.mlp(width=256, depth=2)
    graph = _fast(model, torch.randn(64, 256))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # the step starts without gradients, so their allocation is part of its peak
    assert graph.meta.plain_peak_bytes >= 0.9 * param_bytes
    assert sum(graph.meta.param_bytes.values()) == param_bytes


def test_out_of_memory_falls_back_to_safe_mode(monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(profile_mod, "_plain_peak", out_of_memory)
    model, x = models.residual_cnn(), torch.randn(2, 3, 8, 8)
    with pytest.warns(UserWarning, match="out of memory.*memory-safe"):
        graph = _fast(model, x)
    assert graph.meta.safe is True and graph.meta.plain_peak_bytes is None
    reference = _fast(model, x, safe=True)
    assert [n.saved for n in graph] == [n.saved for n in reference]


def test_other_errors_are_not_taken_for_out_of_memory(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(profile_mod, "_plain_peak", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        _fast(models.mlp(), torch.randn(2, 16))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(ValueError("out of range"))


def test_custom_loss_is_used():
    calls = []

    def loss_fn(out):
        calls.append(out.shape)
        return out.pow(2).mean()

    graph = _fast(models.mlp(), torch.randn(3, 16), loss_fn=loss_fn)
    assert calls and all(shape == (3, 16) for shape in calls)
    assert len(graph) == 5


def test_the_gradients_the_loss_sends_the_outputs_are_measured_with_it():
    """A sum sends the outputs a broadcast scalar (one element); a mean of squares a tensor
    as large as the output. Without a loss, the loop people write is profiled: the outputs
    held to the step's end and a cross-entropy over them, whose gradient is as large as the
    outputs and which holds the log-probabilities beside them."""
    x = torch.randn(3, 16)
    summed = _fast(models.mlp(), x, loss_fn=torch.sum)
    squared = _fast(models.mlp(), x, loss_fn=lambda out: out.pow(2).mean())
    assert summed.meta.output_grad_bytes <= F32  # one element, broadcast
    assert squared.meta.output_grad_bytes == 3 * 16 * F32
    assert not summed.meta.outputs_held and not squared.meta.outputs_held
    loop = _fast(models.mlp(), x)
    assert loop.meta.outputs_held
    assert loop.meta.output_grad_bytes == 3 * 16 * F32
    assert loop.meta.loss_peak_bytes >= 2 * 3 * 16 * F32


def test_output_without_floats_needs_a_loss():
    model = nn.Sequential(nn.Linear(4, 4), _ArgMax())
    with pytest.raises(ValueError, match="loss_fn"):
        _fast(model, torch.randn(2, 4))


class _ArgMax(nn.Module):
    def forward(self, x):
        return x.argmax(dim=1)


def test_fallback_profiles_each_submodule_in_the_models_own_forward():
    from tests.test_trace import DataDependent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        graph = _fast(DataDependent(), torch.randn(5, 4))
        safe = _fast(DataDependent(), torch.randn(5, 4), safe=True)
    assert graph.ids == ["a", "b", "c"]
    assert [graph[i].mem for i in graph.ids] == [5 * 8 * F32, 5 * 8 * F32, 5 * 2 * F32]
    assert graph["b"].saved == 5 * 8 * F32 and graph.meta.saved_refs["b"] == ["b"]
    assert graph["c"].saved == 5 * 8 * F32 and graph.meta.saved_refs["c"] == ["b"]
    assert [n.saved for n in safe] == [n.saved for n in graph]


def test_profiled_graph_survives_json(tmp_path):
    graph = _fast(models.concat_branches(), torch.randn(3, 8))
    path = tmp_path / "g.json"
    graph.save(path)
    loaded = Graph.load(path)
    assert loaded.to_dict() == graph.to_dict()


def test_cli_profile_writes_a_loadable_graph(tmp_path, capsys):
    path = tmp_path / "mlp.json"
    assert main(["profile", "tests.models:mlp", "--batch-size", "4", "--input-shape", "16",
                 "-o", str(path)]) == 0
    assert "wrote" in capsys.readouterr().out
    graph = Graph.load(path)
    assert len(graph) == 5 and graph.meta.batch_size == 4
    assert graph[graph.ids[1]].saved == 4 * 16 * F32
    safe_path = tmp_path / "lm.json"
    assert main(["profile", "tests.models:tiny_lm", "--batch-size", "2", "--input-shape", "8",
                 "--dtype", "long", "--vocab", "50", "--safe", "-o", str(safe_path)]) == 0
    assert Graph.load(safe_path).meta.safe is True


class Tricky(nn.Module):
    """Dropout (RNG), a layer called twice (tied weights), in-place methods, a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = self.fc(x)
        h.add_(1.0)
        h = self.drop(h).relu_()
        return {"out": self.fc(h), "aux": h.argmax(dim=1)}


def test_dropout_tied_weights_inplace_and_dict_output():
    model = Tricky().train()
    x = torch.randn(4, 8)
    normal = _fast(model, x)
    safe = _fast(model, x, safe=True)
    assert normal.ids == ["fc", "add_", "drop", "relu_", "fc_1", "argmax"]
    # the Linear called twice owns its parameters once; their gradient appears in the
    # backward of its last call, the first to run backward
    assert normal.meta.param_bytes == {"fc": (8 * 8 + 8) * F32}
    assert normal.meta.param_grad_bytes == {"fc_1": (8 * 8 + 8) * F32}
    assert sorted(normal.meta.outputs) == ["argmax", "fc_1"]
    assert normal.meta.aliases == {"add_": "fc", "relu_": "drop"}
    # dropout keeps a mask of its own (float on CPU, bool with the fused CUDA kernel);
    # relu_ keeps its result, which is dropout's storage
    assert normal["drop"].saved in (4 * 8 * F32, 4 * 8) and normal.meta.saved_refs["drop"] == []
    assert normal["relu_"].saved == 4 * 8 * F32 and normal.meta.saved_refs["relu_"] == ["drop"]
    assert normal["argmax"].mem == 4 * 8  # int64 indices
    assert normal.meta.requires_grad == {
        "fc": True, "add_": True, "drop": True, "relu_": True, "fc_1": True, "argmax": False,
    }
    assert safe.meta.requires_grad == normal.meta.requires_grad
    assert [n.mem for n in safe] == [n.mem for n in normal]
    assert [n.saved for n in safe] == [n.saved for n in normal]
    assert safe.meta.saved_refs == normal.meta.saved_refs


def test_forward_workspace_is_the_temporary_peak():
    graph = _fast(WithScratch(), torch.randn(4, 8), repeats=2)
    assert graph.ids == ["fc", "plus_big_temporary"]
    ws = graph["plus_big_temporary"].ws_fwd
    assert 0.9 * TEMP_BYTES <= ws <= 1.25 * TEMP_BYTES, ws
    assert graph["fc"].ws_fwd < TEMP_BYTES / 4


class LogitsLoss(nn.Module):
    """A linear layer's logits over a large vocabulary, and their cross-entropy."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.head = nn.Linear(64, vocab)

    def forward(self, x, target):
        return nn.functional.cross_entropy(self.head(x), target)


def test_an_ops_backward_over_several_autograd_nodes_counts_the_gradients_between_them():
    """cross_entropy's backward runs as nll_loss's, which makes the gradient of the
    log-probabilities, then log_softmax's, which makes the logits' gradient while that one
    is live: the log-probabilities' gradient is the op's backward workspace. A linear layer
    (addmm of a transposed weight) hands its weight's gradient on through the transpose:
    that is a gradient handed on, not workspace."""
    batch, vocab = 256, 4096
    logits_bytes = batch * vocab * F32
    graph = _fast(LogitsLoss(vocab), (torch.randn(batch, 64), torch.randint(0, vocab, (batch,))),
                  loss_fn=lambda out: out)
    head, loss = graph.ids[0], graph.ids[-1]
    assert graph[loss].op == "cross_entropy"
    assert 0.99 * logits_bytes <= graph[loss].ws_bwd <= 1.1 * logits_bytes, graph[loss]
    assert graph[head].ws_bwd < 64 * vocab * F32 / 4, graph[head]


def test_a_step_without_backward_is_refused():
    frozen = models.mlp()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="does not require grad"):
        _fast(frozen, torch.randn(2, 16))
    with pytest.raises(ValueError, match="scalar"):
        _fast(models.mlp(), torch.randn(2, 16), loss_fn=lambda out: out)


def double_in_place(h):
    return h.mul_(2)


torch.fx.wrap("double_in_place")


class HiddenInplace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h = double_in_place(h)  # in-place, but neither its name nor a keyword says so
        return self.fc(h)


def test_safe_mode_handles_inplace_ops_it_did_not_recognise():
    x = torch.randn(3, 4)
    normal = _fast(HiddenInplace(), x)
    safe = _fast(HiddenInplace(), x, safe=True)
    assert [n.saved for n in safe] == [n.saved for n in normal]
    assert safe.meta.aliases == normal.meta.aliases == {"double_in_place": "fc"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiling_on_cuda_matches_cpu_bytes():
    torch.manual_seed(0)
    model, x = models.residual_cnn(), torch.randn(4, 3, 16, 16)
    on_cpu = _fast(model, x)
    model, x = model.cuda(), x.cuda()
    normal = profile_module(model, x, warmup=1, repeats=3)
    safe = profile_module(model, x, warmup=1, repeats=3, safe=True)
    assert normal.meta.device.startswith("cuda")
    assert [n.mem for n in normal] == [n.mem for n in on_cpu]
    assert [n.saved for n in normal] == [n.saved for n in safe]
    assert normal["relu"].saved == normal["relu"].mem
    assert all(n.t_fwd > 0 for n in normal) and normal["conv2"].t_bwd > 0
    assert normal.meta.plain_peak_bytes > 0


def test_one_out_of_memory_test_knows_every_allocator():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def _record(**times):
    record = OpRecord()
    for vid, t in times.items():
        record.t_fwd[vid] = t
    return record


def test_a_timed_step_repeats_only_while_op_times_vary():
    """One timed step where one will do: a second only when the time in doubt could move
    a plan (docs/design.md section 3)."""
    metered = _record(a=1.2, b=2.2)  # the metered step: the meter's cost on every op
    assert profile_mod._time_in_doubt([_record(a=1.0, b=2.0)], metered, None) == 0.0
    disturbed = profile_mod._time_in_doubt([_record(a=1.0, b=3.0)], metered, None)
    assert disturbed == pytest.approx(0.8 / 4.0)  # b ran slower than under the meter
    # Two timed steps: the ops that moved by more than a quarter carry the doubt.
    steady = [_record(a=1.0, b=2.0), _record(a=1.05, b=2.1)]
    assert profile_mod._time_in_doubt(steady, None, None) == 0.0
    varying = [_record(a=1.0, b=2.0), _record(a=1.05, b=3.0)]
    assert profile_mod._time_in_doubt(varying, None, None) == pytest.approx(3.0 / 4.05)
    # CUDA (no metered step): the ops' sum against the plain step they are part of.
    assert profile_mod._time_in_doubt([_record(a=1.0, b=2.0)], None, 3.5) == 0.0
    assert profile_mod._time_in_doubt([_record(a=1.0, b=3.0)], None, 3.0) == pytest.approx(0.25)


def test_profile_counts_its_steps(monkeypatch):
    """The normal mode on the CPU: one plain step in the meter, one instrumented step in the
    meter, timed steps only while times vary (none vary here), one no-grad forward at
    another batch size, and one more without autograd on which the loss's memory is
    measured (the given loss's, or the cross-entropy the profile stands in for it)."""
    monkeypatch.setattr(profile_mod, "_time_in_doubt", lambda *args: 0.0)
    model = models.mlp()
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(torch.is_grad_enabled()))
    x = torch.randn(8, 16)
    traced = trace_module(model, x)
    calls.clear()
    phases = []
    profile_module(model, x, repeats=3, progress=phases.append, traced=traced)
    # The instrumented steps and the batch-size probe run the traced copy's code; the
    # model's own forward runs twice: for the plain step and, without autograd, the loss.
    assert calls == [True, False]
    assert phases[0] == "profile: the plain step's peak"
    assert sum("times" in p or "timing again" in p for p in phases) == 1
    monkeypatch.setattr(profile_mod, "_time_in_doubt", lambda *args: 1.0)
    phases.clear()
    profile_module(model, x, repeats=3, progress=phases.append, traced=traced)
    assert sum("times" in p or "timing again" in p for p in phases) == 3


def test_a_loss_that_keeps_the_outputs_alive_is_named() -> None:
    """The plan counts the outputs freed when the backward starts; a loss whose reference
    cycle keeps them until the garbage collector runs gets a warning, a plain one none."""
    import gc

    def cyclic_loss(outputs: torch.Tensor) -> torch.Tensor:
        kept: list[torch.Tensor] = []

        def visit(value: torch.Tensor) -> None:  # refers to itself: a cycle holding ``kept``
            kept.append(value)
            if value.dim() > 9:
                visit(value)

        visit(outputs)
        return kept[0].pow(2).mean()

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(4, 8)
    enabled = gc.isenabled()
    gc.disable()  # the cycle must outlive the check, as it does between collections
    try:
        with pytest.warns(UserWarning, match="keeps the module's outputs alive"):
            profile_module(model, x, loss_fn=cyclic_loss)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            graph = profile_module(model, x, loss_fn=lambda out: out.pow(2).mean())
    finally:
        if enabled:
            gc.enable()
    assert graph.meta.loss_peak_bytes is not None and graph.meta.loss_peak_bytes > 0


def test_the_profile_counts_the_mapped_buffers_one_op_holds_at_once():
    """A grouped convolution through im2col (oneDNN off) computes each group into a buffer
    of its own before joining them: with 8 groups of 128 KiB (the C library's default mmap
    threshold, each mapped on pages of its own) the profile counts at least 8, which the
    CPU margin gives a page each; the same convolution ungrouped holds one."""
    from lightning_remat.solvers.scoring import model_margin

    counts, margins = {}, {}
    for groups in (8, 1):
        with torch.backends.mkldnn.flags(enabled=False):
            model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=groups), nn.ReLU())
            graph = profile_module(model, torch.randn(32, 8, 32, 32), repeats=1)
        counts[groups], margins[groups] = graph.meta.scratch_buffers, model_margin(graph)
    assert counts[8] >= 8 > counts[1] >= 1
    assert margins[8] - margins[1] >= 6 * 4096
