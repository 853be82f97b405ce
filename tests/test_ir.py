import json

import pytest

from lightning_remat.graph.ir import Graph, Node

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
    assert s.meta["batch_size"] == 8
    assert g.graph_hash() == s.graph_hash()  # structure, not costs
