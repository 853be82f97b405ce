import pytest

from lightning_remat import RematInfeasibleError, parse_budget
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan, plain_plan


@pytest.mark.parametrize(
    "text, expected",
    [(4096, 4096), ("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", int(1.5 * 2**30)),
     ("60%", 600), (0.25, 250), ("100%", 1000), ("2k", 2048)],
)
def test_budget_forms(text, expected):
    assert parse_budget(text, plain_peak_bytes=1000) == expected


@pytest.mark.parametrize("bad", ["lots", "4 parsecs", "-3GiB", "0%", "150%", 0, -5, 1.5, True, [1]])
def test_bad_budgets_name_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_budget(bad, plain_peak_bytes=1000)


def test_relative_budget_needs_the_plain_peak():
    with pytest.raises(ValueError, match="relative to the plain step's peak"):
        parse_budget("50%")


def test_infeasible_message_gives_smallest_budget_in_human_units():
    err = RematInfeasibleError(1000, 3 * 2**20, "kusumoto-tc")
    assert "3.00 MiB" in str(err) and "3145728 bytes" in str(err)
    assert err.min_budget_bytes == 3 * 2**20


def test_plan_json_has_exactly_the_keys():
    g = Graph.chain([10, 10, 10, 10])
    plan = make_plan(g, [(["v0", "v1"], "recompute"), (["v2", "v3"], "keep")], "test")
    data = plan.to_dict()
    assert set(data) == {"stages", "stored", "predicted_peak_bytes", "predicted_extra_seconds",
                         "solver", "feasible", "margin_bytes"}
    assert Plan.from_json(plan.to_json()) == plan
    # A plan written before the margin existed still reads, with no margin.
    del data["margin_bytes"]
    assert Plan.from_dict(data).margin_bytes == 0
    assert plan.stored == ["v1", "v2", "v3"]
    assert plan.predicted_extra_seconds == 1.0  # v0 runs again; v1, the boundary, is kept


def test_plan_validation_catches_bad_stages():
    g = Graph.chain([1, 1, 1])
    with pytest.raises(ValueError, match="runs from stage 1 back to 0"):
        Plan([Stage(["v2"]), Stage(["v0", "v1"])], [], 0, 0, "x", True).validate(g)
    with pytest.raises(ValueError, match="in no stage"):
        Plan([Stage(["v0"])], [], 0, 0, "x", True).validate(g)
    with pytest.raises(ValueError, match="not one of"):
        Stage(["v0"], "discard")


def test_recomputation_lowers_the_predicted_peak():
    g = Graph.chain([100] * 8)
    plain = plain_plan(g)
    cut = make_plan(g, [(g.ids[:3], "recompute"), (g.ids[3:6], "recompute"), (g.ids[6:], "keep")], "test")
    assert cut.predicted_peak_bytes < plain.predicted_peak_bytes
    assert make_plan(g, [(g.ids, "keep")], "t", budget_bytes=plain.predicted_peak_bytes - 1).feasible is False
