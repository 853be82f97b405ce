"""Every transformers architecture of :mod:`tests.hf_architectures` (small sizes, the config's
defaults otherwise: the cache on, sdpa or the family's own attention, dropout as shipped)
trains under a plan as it trains plainly: a padded batch with an attention mask and labels
-100 on the padding, two SGD steps, each compared with a plain copy from the same seed (the
loss, every gradient, the weights after).

The plan is Chen et al.'s sqrt(n) segments (``solver="chen"``) at the plain peak (or the
smallest budget it names where its checkpoint frames outweigh what it frees): more
recomputed stages than a budget-driven plan of these small models has (3 to 18), so every kind of op these families run (rotary tables, routers with ``topk``,
in-place mask writes, custom autograd functions, dropout) is run again in some stage, at a
planning cost of about a second per model. The zoo tests plan GPT-2, Qwen2 and T5 with
``auto`` at 50% and hold their peaks to the allocator's edge.

The loss, every gradient and the weights after are equal to the bit: the capture runs the
ops plain training runs (docs/design.md section 3, "Plain's ops") and Chen's segments run
them in the forward's order (section 5, "Plain's order"), for every architecture here
(2026-12-06, this CPU, one thread).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from lightning_remat import RematInfeasibleError, remat
from tests.hf_architectures import ARCHITECTURES, available, build, one_thread  # noqa: F401 - autouse fixture

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_an_architecture_with_its_default_config_trains_under_a_plan_as_plainly(model_type: str) -> None:
    if not available(model_type):
        pytest.skip(f"transformers {transformers.__version__} ships no {model_type}")
    torch.manual_seed(0)
    model, batch = build(model_type)
    model.train()
    plain = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache notice, the first step's measurement
        try:
            planned = remat(model, batch, "100%", solver="chen", loss_fn=lambda out: out.loss)
        except RematInfeasibleError as refused:  # the checkpoint frames outweigh what it frees
            assert refused.min_budget_bytes is not None, refused
            planned = remat(model, batch, refused.min_budget_bytes, solver="chen", loss_fn=lambda out: out.loss)
    capture = planned.plan.notes[0]
    assert capture.startswith("capture: torch.export"), capture  # op by op, not the fallback
    assert planned.plan.count("recompute") >= 3, planned.plan.stages

    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    for step in range(2):
        losses = []
        for module, optimizer in ((planned, optimizers[0]), (plain, optimizers[1])):
            optimizer.zero_grad(set_to_none=True)
            torch.manual_seed(100 + step)  # dropout: both steps draw from one state
            loss = module(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        assert not [n for n in planned.plan.notes if n.startswith("order:")], planned.plan.notes
        for (key, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            assert (p.grad is None) == (q.grad is None), key
            if q.grad is not None:
                assert torch.equal(p.grad, q.grad), (step, key, float((p.grad - q.grad).abs().max()))
        for optimizer in optimizers:
            optimizer.step()
    for (key, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(p, q), key
