"""Graphs derived for another batch size (graph/scale.py) against real profiles at that size."""

from __future__ import annotations

import pytest
import torch

from lightning_remat.graph.ir import Graph
from lightning_remat.graph.profile import profile_module
from lightning_remat.graph.scale import derive_graph
from lightning_remat.graph.trace import trace_module
from lightning_remat.solvers import simulate
from lightning_remat.solvers.policy import plain_peak_bytes
from tests import models

CASES = {
    "mlp": (lambda: models.mlp(width=64, depth=3), lambda b: torch.randn(b, 64)),
    "residual_cnn": (models.residual_cnn, lambda b: torch.randn(b, 3, 16, 16)),
    "tiny_lm": (models.tiny_lm, lambda b: torch.randint(0, 50, (b, 10))),
}


def _profile(name: str, batch: int) -> Graph:
    factory, example = CASES[name]
    torch.manual_seed(0)
    model = factory()
    x = example(batch)
    return profile_module(model, x, traced=trace_module(model, x), repeats=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_derived_graph_predicts_the_real_profiles_peak(name):
    """Profiles at 2 and 4 give the graph at 12; its simulated peak is within 3% of the
    simulated peak of a real profile at 12 (docs/design.md section 4.7's target), and its
    bytes are the measured ones."""
    family = [_profile(name, 2), _profile(name, 4)]
    real = _profile(name, 12)
    derived = derive_graph(family, 12)
    assert derived.ids == real.ids and derived.meta.batch_size == 12
    predicted, measured = simulate(derived).peak_bytes, simulate(real).peak_bytes
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    for node in real:
        assert derived[node.id].mem == node.mem, node.id
        assert derived[node.id].saved == node.saved, node.id
    assert derived.meta.saved_input_bytes == real.meta.saved_input_bytes
    assert derived.meta.input_bytes == real.meta.input_bytes
    # Beyond the profiled sizes the plain peak is the simulator's (the measured line may
    # fall below a convex peak there), as close to the measured one.
    assert derived.meta.plain_peak_bytes is None
    assert abs(plain_peak_bytes(derived) - real.meta.plain_peak_bytes) <= 0.03 * real.meta.plain_peak_bytes
    assert derived.meta.param_bytes == real.meta.param_bytes
    assert all(n.t_fwd >= 0 and n.t_bwd >= 0 for n in derived)


def test_one_profile_scales_the_batch_dependent_vertices_only():
    graph = _profile("tiny_lm", 2)
    derived = derive_graph([graph], 6)
    assert derived["head"].mem == 3 * graph["head"].mem
    assert derived["getitem"].mem == graph["getitem"].mem  # a parameter slice
    assert derived.meta.plain_peak_bytes is None  # left to the simulator
    assert derive_graph([graph], 2).to_dict() == graph.to_dict()


def test_times_never_fall_with_the_batch():
    small = Graph.chain([100, 100], t_fwd=[2.0, 1.0])
    small.meta.batch_size = 2
    large = Graph.chain([200, 200], t_fwd=[1.0, 2.0])  # a noisy first op
    large.meta.batch_size = 4
    derived = derive_graph([small, large], 8)
    assert derived.nodes[0].t_fwd == 1.0 and derived.nodes[1].t_fwd == pytest.approx(4.0)
    assert [n.mem for n in derived] == [400, 400]
    assert derive_graph([large, small], 1).nodes[0].mem == 50  # order does not matter


def test_bad_families_are_refused():
    a = Graph.chain([1, 2])
    with pytest.raises(ValueError, match="batch_size"):
        derive_graph([a], 4)
    a.meta.batch_size = 2
    b = Graph.chain([1, 2, 3])
    b.meta.batch_size = 4
    with pytest.raises(ValueError, match="different graphs"):
        derive_graph([a, b], 8)
    with pytest.raises(ValueError, match="same batch size"):
        derive_graph([a, a], 8)
    with pytest.raises(ValueError, match="one or two"):
        derive_graph([], 8)
    with pytest.raises(ValueError, match="batch_size=0"):
        derive_graph([a], 0)


def test_the_measured_plain_peak_is_carried_only_between_the_profiled_sizes():
    """A step's peak is the largest of its moments, each affine in the batch: convex. The
    line through two measured peaks bounds it from above between them and from below
    beyond them (ResNet-101 on the CPU: the line from batch 4 and 8 put batch 21 at 553 MB,
    where it measured 712 MB), so beyond them the derived graph leaves it to the simulator."""
    small = Graph.chain([100, 100], t_fwd=[1.0, 1.0])
    small.meta.batch_size, small.meta.plain_peak_bytes = 2, 1000
    large = Graph.chain([200, 200], t_fwd=[1.0, 1.0])
    large.meta.batch_size, large.meta.plain_peak_bytes = 4, 1400
    assert derive_graph([small, large], 3).meta.plain_peak_bytes == 1200
    for outside in (1, 8):
        derived = derive_graph([small, large], outside)
        assert derived.meta.plain_peak_bytes is None
        assert plain_peak_bytes(derived) == simulate(derived).peak_bytes
