import json
from pathlib import Path

import pytest

from lightning_remat.graph.ir import Graph, GraphMeta, Node

EXAMPLE = {
    "nodes": [
        {"id": "conv1", "op": "Conv2d", "mem": 1048576, "saved": 1048576,
         "t_fwd": 0.0012, "t_bwd": 0.0025, "ws_fwd": 0, "ws_bwd": 0},
        {"id": "bn1", "op": "BatchNorm2d", "mem": 1048576, "saved": 1048832,
         "t_fwd": 0.0004, "t_bwd": 0.0007, "ws_fwd": 0, "ws_bwd": 0},
    ],
    "edges": [["conv1", "bn1"]],
    "meta": {"batch_size": 32, "device": "cuda:0", "dtype": "float32"},
}


def test_round_trip_keeps_exact_form(tmp_path):
    graph = Graph.from_dict(EXAMPLE)
    path = tmp_path / "g.json"
    graph.save(path)
    data = json.loads(path.read_text())
    assert data == EXAMPLE
    assert Graph.load(path).to_dict() == EXAMPLE


def test_nodes_come_back_in_topological_order():
    data = {"nodes": [dict(EXAMPLE["nodes"][1]), dict(EXAMPLE["nodes"][0])],
            "edges": [["conv1", "bn1"]], "meta": {}}
    assert Graph.from_dict(data).ids == ["conv1", "bn1"]


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda d: d["edges"].append(["bn1", "conv1"]), "cycle"),
        (lambda d: d["edges"].append(["bn1", "bn1"]), "cycle"),
        (lambda d: d["edges"].append(["conv1", "relu9"]), "unknown node id 'relu9'"),
        (lambda d: d["nodes"][0].update(mem=-1), "negative cost mem=-1"),
        (lambda d: d["nodes"][1].update(t_bwd=-0.5), "negative cost t_bwd"),
        (lambda d: d["nodes"].append(dict(d["nodes"][0])), "duplicate node id 'conv1'"),
        (lambda d: d["nodes"][0].update(mem="big"), "not a number"),
        (lambda d: d["nodes"][1].update(t_fwd=float("inf")), "t_fwd=inf is not a finite number"),
        (lambda d: d["nodes"][1].update(t_bwd=float("nan")), "t_bwd=nan is not a finite number"),
        (lambda d: d["nodes"][0].update(mem=float("inf")), "mem=inf is not a finite number"),
        (lambda d: d["nodes"][0].update(colour=3), "unknown keys ['colour']"),
        (lambda d: d.update(edges=[["conv1"]]), "not a [from_id, to_id] pair"),
    ],
)
def test_bad_files_raise_value_error_naming_the_problem(mutate, words):
    data = json.loads(json.dumps(EXAMPLE))
    mutate(data)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Graph.from_json(json.dumps(data))


def test_not_json_is_a_value_error():
    with pytest.raises(ValueError, match="not valid JSON"):
        Graph.from_json("{nodes:")


def test_chain_and_queries():
    g = Graph.chain([4, 8, 2], t_fwd=[1, 2, 3])
    assert g.is_chain()
    assert g.successors("v0") == ["v1"] and g.predecessors("v2") == ["v1"]
    assert g.total("mem") == 14 and g["v1"].t_bwd == 4.0
    branched = Graph([Node("a", "x"), Node("b", "x"), Node("c", "x")], [("a", "b"), ("a", "c"), ("b", "c")])
    assert not branched.is_chain()


def test_scaling_by_batch_size():
    g = Graph.chain([100, 200], meta={"batch_size": 4, "batch_dependent": {"v1": False}})
    s = g.scaled(8)
    assert s["v0"].mem == 200 and s["v0"].t_fwd == 2.0
    assert s["v1"].mem == 200  # declared batch-independent
    assert s.meta.batch_size == 8
    assert g.graph_hash() == s.graph_hash()  # structure, not costs


# ---- typed metadata ---------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
COMMITTED = sorted((REPO / "benchmarks" / "graphs").glob("*.json")) + sorted(
    (REPO / "tests" / "data").glob("*.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_committed_graphs_load_and_round_trip(path):
    data = json.loads(path.read_text())
    graph = Graph.load(path)
    assert graph.to_dict() == data
    assert isinstance(graph.meta, GraphMeta) and graph.meta.saved_refs is not None
    assert Graph.from_json(graph.to_json()).to_dict() == data


def test_profiled_graphs_are_written_back_unchanged():
    # Fields are written in the profiler's order, the benchmarks' "model" after them.
    for path in sorted((REPO / "benchmarks" / "graphs").glob("*.json")):
        assert Graph.load(path).to_json(indent=1) == path.read_text(), path.name
        model = json.loads(path.read_text())["meta"]["model"]
        assert Graph.load(path).meta.extra == {"model": model}


def test_meta_fields_and_extra_keys():
    meta = GraphMeta.from_dict({"batch_size": 4, "saved_refs": {"a": ["a"]}, "model": "m",
                                "image_size": 224, "aliases": None})
    assert meta.batch_size == 4 and meta.saved_refs == {"a": ["a"]}
    assert meta.aliases is None and meta.param_bytes is None  # null is absent
    assert meta.extra == {"model": "m", "image_size": 224}
    assert meta.to_dict() == {"batch_size": 4, "saved_refs": {"a": ["a"]}, "model": "m",
                              "image_size": 224}
    assert GraphMeta().to_dict() == {}
    assert list(GraphMeta(safe=True, batch_size=2).to_dict()) == ["batch_size", "safe"]
    with pytest.raises(ValueError, match="fields of GraphMeta"):
        GraphMeta(extra={"batch_size": 3})


def test_graph_takes_a_dict_or_a_graph_meta():
    nodes = [Node("a", "x", mem=4)]
    from_dict = Graph(nodes, [], {"outputs": ["a"], "costs": "estimated"})
    assert isinstance(from_dict.meta, GraphMeta)
    assert from_dict.meta.outputs == ["a"] and from_dict.meta.extra == {"costs": "estimated"}
    assert Graph(nodes, [], GraphMeta(outputs=["a"], extra={"costs": "estimated"})) == from_dict
    assert Graph(nodes, []).meta == GraphMeta()
    with pytest.raises(ValueError, match="'meta' must be an object"):
        Graph(nodes, [], ["outputs"])


def test_absent_and_empty_stay_apart():
    empty = {"saved_refs": {}, "aliases": {}, "param_bytes": {}, "outputs": []}
    meta = GraphMeta.from_dict(empty)
    assert meta.saved_refs == {} and meta.aliases == {} and meta.param_bytes == {}
    assert meta.outputs == [] and meta.to_dict() == empty
    absent = GraphMeta.from_dict({})
    assert absent.saved_refs is None and absent.aliases is None and absent.param_bytes is None


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("batch_size", "32", "'batch_size' must be a whole number"),
        ("batch_size", True, "'batch_size' must be a whole number"),
        ("input_bytes", 1.5, "'input_bytes' must be a whole number"),
        ("step_seconds", "fast", "'step_seconds' must be a number"),
        ("device", 0, "'device' must be a string"),
        ("safe", 1, "'safe' must be true or false"),
        ("outputs", "fc", "'outputs' must be a list of node ids"),
        ("shape_edges", [["a"]], "'shape_edges' must be a list of [from_id, to_id] pairs"),
        ("saved_refs", ["a"], "'saved_refs' must be an object keyed by node id"),
        ("saved_refs", {"a": "a"}, "'saved_refs' entry 'a' must be a list of node ids"),
        ("param_bytes", {"fc": "big"}, "'param_bytes' entry 'fc' must be a whole number"),
        ("aliases", {"v": 3}, "'aliases' entry 'v' must be a string"),
        ("aliases", {"a": "b", "b": "a"}, "'aliases' form a cycle"),
        ("aliases", {"a": "b", "b": "c", "c": "a", "d": "a"}, "'aliases' form a cycle"),
        ("aliases", {"a": "a"}, "'aliases' form a cycle"),
        ("input_bytes", -1, "'input_bytes' must not be negative"),
        ("param_bytes", {"fc": -8}, "'param_bytes' entry 'fc' must not be negative"),
        ("input_bytes", float("inf"), "'input_bytes' must be a whole number"),
        ("step_seconds", float("inf"), "'step_seconds' must be a finite number"),
        ("step_seconds", float("nan"), "'step_seconds' must be a finite number"),
        ("bandwidth_bytes_per_s", -1e9, "'bandwidth_bytes_per_s' must not be negative"),
        ("batch_dependent", {"v": 0}, "'batch_dependent' entry 'v' must be true or false"),
    ],
)
def test_bad_meta_raises_value_error_naming_the_key(key, value, words):
    data = json.loads(json.dumps(EXAMPLE))
    data["meta"][key] = value
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        Graph.from_json(json.dumps(data))


def test_whole_numbers_are_kept_as_int_and_rates_as_float():
    meta = GraphMeta.from_dict({"input_bytes": 64.0, "param_bytes": {"a": 8.0},
                                "bandwidth_bytes_per_s": 1000000000})
    assert meta.input_bytes == 64 and isinstance(meta.input_bytes, int)
    assert isinstance(meta.param_bytes["a"], int)
    assert meta.bandwidth_bytes_per_s == 1e9 and isinstance(meta.bandwidth_bytes_per_s, float)


def test_copies_and_scaling_leave_the_original_alone():
    g = Graph.chain([100, 200], meta={"batch_size": 4, "input_bytes": 40, "model": "m",
                                      "saved_refs": {"v1": ["v0"]}})
    s = g.scaled(8)
    assert s.meta.input_bytes == 80 and s.meta.extra == {"model": "m"}
    s.meta.extra["model"] = "other"
    s.meta.saved_refs["v1"].append("v1")
    assert g.meta.extra == {"model": "m"} and g.meta.saved_refs == {"v1": ["v0"]}
    assert g.meta.batch_size == 4 and g.meta.input_bytes == 40
    with pytest.raises(ValueError, match="no meta.batch_size"):
        Graph.chain([1]).scaled(2)
