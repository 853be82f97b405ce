"""Hugging Face transformers models, random-initialised from tiny configs (no download):
torch.fx cannot trace their forwards (``*args``/``**kwargs``, branches on arguments), so
``remat`` captures them with non-strict ``torch.export`` and plans over their ATen ops.

Each model is planned once (a module-scoped cache; planning profiles it) at 50% of its plain
peak, its config's defaults kept: the cache on (the planned module's calls turn it off, as
Hugging Face's own gradient checkpointing does in training; the capture runs it as plain
training does), dropout as shipped (the planned and the plain step draw from one generator
state), sdpa attention. Qwen2's smallest budget with sdpa was 52% of its plain peak while
the capture materialised the causal mask plain training leaves to sdpa (2026-12-06, this
CPU); captured with plain's ops it fits 50%.

Gradients are compared to the bit, but where the plan's stages run ops out of the
forward's order (its "order:" note; docs/design.md section 5, "Plain's order"), to float
rounding.

CPU reductions run on one thread here: a multi-threaded reduction splits its work by the
threads the OS gives it, which on a loaded machine changes from call to call, so an op run
again could differ from its forward in the last bit whatever the plan.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_remat import remat
from lightning_remat.errors import RematInfeasibleError, SolverDeclinedError
from lightning_remat.measure.peak import peak_bytes
from lightning_remat.solvers import SOLVERS, min_budget, solve
from lightning_remat.solvers.policy import plain_peak_bytes
from tests.hf_architectures import one_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # export, profile and solve: tens of seconds per model on a busy CPU

VOCAB = 128


def gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64)
    return transformers.GPT2LMHeadModel(config), {"input_ids": torch.randint(0, VOCAB, (8, 64))}


def qwen2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config), {"input_ids": torch.randint(0, VOCAB, (8, 64))}


def t5() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=3, num_decoder_layers=3,
        num_heads=2)
    return transformers.T5ForConditionalGeneration(config), {
        "input_ids": torch.randint(0, VOCAB, (16, 32)),
        "decoder_input_ids": torch.randint(0, VOCAB, (16, 32)),
    }


MODELS: dict[str, Callable[[], tuple[nn.Module, dict[str, torch.Tensor]]]] = {
    "gpt2": gpt2, "qwen2": qwen2, "t5": t5,
}


@pytest.fixture(scope="module")
def planned() -> dict[str, Any]:
    """Per model name: (model, a plain copy made before planning, the call, remat's module)."""
    cache: dict[str, Any] = {}
    return cache


def _planned(cache: dict[str, Any], name: str) -> tuple[nn.Module, nn.Module, dict[str, torch.Tensor], nn.Module]:
    if name not in cache:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.manual_seed(0)
            model, call = MODELS[name]()
            model.train()
            plain = copy.deepcopy(model)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cache[name] = (model, plain, call, remat(model, call, "50%"))
            cache[name, "warnings"] = [str(w.message) for w in caught]
        finally:
            torch.set_num_threads(threads)
    return cache[name]


def assert_bits(got: torch.Tensor, expected: torch.Tensor, plan: Any, key: str) -> None:
    """``got`` equal to ``expected`` to the bit; to float rounding where ``plan``'s stages run
    ops out of the forward's order, which can sum a gradient otherwise (module docstring)."""
    if any(note.startswith("order:") for note in plan.notes):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()),
                                   msg=lambda text: f"{key}: {text}")
    else:
        assert torch.equal(got, expected), (key, float((got - expected).abs().max()))


def _step(module: nn.Module, owner: nn.Module, call: dict[str, torch.Tensor]) -> None:
    owner.zero_grad(set_to_none=True)  # the gradients are allocated in the step
    module(**call).logits.sum().backward()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_transformers_model_is_captured_by_export_and_planned_at_half_its_plain_peak(
        name: str, planned: dict[str, Any]) -> None:
    model, plain, call, remat_model = _planned(planned, name)
    note = remat_model.plan.notes[0]
    match = re.match(r"capture: torch\.export \(non-strict\), (\d+) vertices", note)
    assert match is not None, note
    # One vertex per ATen op: more than ten per layer, not the fallback's two.
    assert int(match.group(1)) == len(remat_model.graph) > 100
    assert remat_model.plan.count("recompute") > 0
    assert remat_model.budget_bytes <= 0.5 * plain_peak_bytes(remat_model.graph) + 1

    for _ in range(2):  # warm-up
        _step(remat_model, model, call)
    torch.manual_seed(7)  # dropout as the configs ship it: both steps draw from one state
    measured = peak_bytes(lambda: _step(remat_model, model, call))
    assert measured <= remat_model.budget_bytes

    torch.manual_seed(7)
    _step(plain, plain, call)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for (key, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert p.grad is not None, key
        assert_bits(p.grad, q.grad, remat_model.plan, key)
    for (key, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(b, c), key
    out = remat_model(**call)  # the model's own output type, as the plain model returns
    assert type(out) is type(plain(**call))


@pytest.mark.parametrize("name", list(MODELS))
def test_no_solver_crashes_on_a_captured_transformers_graph(name: str, planned: dict[str, Any]) -> None:
    """Every solver, from its smallest budget to the plain peak: a plan, or
    RematInfeasibleError. The exact DPs decline a graph with more lower sets than their
    limit, naming the approximate ones (SolverDeclinedError, a RematInfeasibleError)."""
    graph = _planned(planned, name)[3].graph
    plain = plain_peak_bytes(graph)
    for solver, entry in SOLVERS.items():
        if entry.offloads:
            continue  # the CPU offloads nothing (the planner refuses them there)
        try:
            lowest = min_budget(graph, solver)
        except SolverDeclinedError as refused:
            assert solver.startswith("kusumoto-exact") and "lower sets" in str(refused), (solver, refused)
            continue
        except RematInfeasibleError:
            continue
        for budget in sorted({lowest, (lowest + plain) // 2, plain}):
            try:
                plan = solve(graph, budget, solver)
            except RematInfeasibleError:
                continue
            assert plan.stages, solver


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_a_decoders_default_cache_is_turned_off_for_its_calls_with_one_warning(
        name: str, planned: dict[str, Any]) -> None:
    """``use_cache=True`` as the config ships it: the planned module's calls run without
    the cache (captured op by op above), one warning says so and how to choose, and the
    user's config is left as it was; a call that asks for the cache gets it."""
    model, _, call, remat_model = _planned(planned, name)
    assert model.config.use_cache
    said = [w for w in planned[name, "warnings"] if "cache of past keys and values" in w]
    assert len(said) == 1 and "use_cache=False" in said[0], planned[name, "warnings"]
    assert remat_model(**call).past_key_values is None
    remat_model.eval()
    try:
        with torch.no_grad():  # evaluation: its own forward, nothing to plan
            assert remat_model(**call, use_cache=True).past_key_values is not None
    finally:
        remat_model.train()


def test_a_lightning_module_holding_a_decoder_with_its_default_config_is_planned_op_by_op(tmp_path) -> None:
    """The job most users have: a LightningModule holding a decoder whose config keeps its
    cache on, under ``Trainer(strategy=RematStrategy("50%"))``. Its forward returns the
    decoder's output; with the decoder's cache off in the planned calls it is captured op by
    op (not the fallback's few submodules), and three steps train as plain Lightning does,
    to the bit (tests/test_plain_bits.py holds every step's gradients)."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_remat.lightning.strategy import RematStrategy

    class Decoder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()[0]

        def forward(self, ids: torch.Tensor) -> Any:
            return self.model(input_ids=ids, labels=ids)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0]).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ids = torch.randint(0, VOCAB, (24, 64), generator=torch.Generator().manual_seed(1))
    trained = {}
    for name, strategy in (("plain", "auto"), ("remat", RematStrategy(memory_budget="50%"))):
        pl.seed_everything(0)
        module = Decoder()
        assert module.model.config.use_cache
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, default_root_dir=str(tmp_path / name))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, DataLoader(TensorDataset(ids), batch_size=8))
        trained[name] = module
        if name == "remat":
            (entry,) = strategy.planner.planned.values()
            assert len(entry.graph) > 100 and entry.plan.count("recompute") > 0, entry.plan.notes
            assert any("cache of past keys and values" in str(w.message) for w in caught)
            assert module.model.config.use_cache  # the user's config as it was
    for (key, p), (_, q) in zip(trained["remat"].named_parameters(), trained["plain"].named_parameters()):
        assert_bits(p.detach(), q.detach(), entry.plan, key)
