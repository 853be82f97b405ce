import pytest

from lightning_remat import RematInfeasibleError, parse_budget
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers.plan import Plan, Stage
from lightning_remat.solvers.scoring import make_plan, plain_plan


@pytest.mark.parametrize(
    "text, expected",
    [(4096, 4096), ("4GiB", 4 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", int(1.5 * 2**30)),
     ("60%", 600), (0.25, 250), ("100%", 1000), ("2k", 2048),
     ("0.25", 250), (" 0.6 ", 600), ("1.0", 1000), ("4096", 4096)],
)
def test_budget_forms(text, expected):
    assert parse_budget(text, plain_peak_bytes=1000) == expected


@pytest.mark.parametrize("bad", ["lots", "4 parsecs", "-3GiB", "0%", "150%", 0, -5, 1.5, True, [1],
                                 "1.5", "0.0", "0"])
def test_bad_budgets_name_the_accepted_forms(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        parse_budget(bad, plain_peak_bytes=1000)


def test_a_bad_budget_string_lists_every_accepted_form():
    for bad in ("lots", "150%", "1.5", "4 parsecs"):
        with pytest.raises(ValueError) as info:
            parse_budget(bad, plain_peak_bytes=1000)
        assert all(form in str(info.value) for form in ("4294967296", "'4GiB'", "'60%'", "'0.6'"))


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


@pytest.mark.parametrize(
    "key, value, words",
    [("stages", [{"nodes": [["v0"]], "action": "keep"}], "stage 0 nodes must be a list of vertex ids"),
     ("stages", [{"nodes": "v0", "action": "keep"}], "stage 0 nodes must be a list of vertex ids"),
     ("stored", [1], "stored must be a list of vertex ids"),
     ("predicted_extra_seconds", float("nan"), "predicted_extra_seconds=nan is not a finite number"),
     ("predicted_extra_seconds", float("inf"), "predicted_extra_seconds=inf is not a finite number")],
)
def test_a_malformed_plan_raises_value_error_naming_the_key(key, value, words):
    data = plain_plan(Graph.chain([10, 10])).to_dict()
    data[key] = value
    with pytest.raises(ValueError, match=words):
        Plan.from_dict(data)


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
