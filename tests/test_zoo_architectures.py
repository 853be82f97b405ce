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

Gradients equal up to float rounding: a value read by several ops sums its gradient in the
order the backward reaches its readers, which recomputation can change.
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
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
        for (key, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
            assert (p.grad is None) == (q.grad is None), key
            if q.grad is not None:
                torch.testing.assert_close(
                    p.grad, q.grad, rtol=1e-5, atol=1e-5 * float(q.grad.abs().max()),
                    msg=lambda text, key=key, step=step: f"step {step}, {key}: {text}")
        for optimizer in optimizers:
            optimizer.step()
    for (key, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda text, key=key: f"{key}: {text}")
