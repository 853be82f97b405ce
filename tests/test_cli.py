from lightning_remat.cli import main
from lightning_remat.graph.ir import Graph


def test_solve_plain_prints_a_table(tmp_path, capsys):
    path = tmp_path / "g.json"
    Graph.chain([100] * 5).save(path)
    assert main(["solve", "--graph", str(path), "--budget", "100%", "--solver", "plain"]) == 0
    out = capsys.readouterr().out
    assert "solver: plain" in out and "keep" in out


def test_infeasible_budget_exits_2_with_the_smallest_budget(tmp_path, capsys):
    path = tmp_path / "g.json"
    Graph.chain([100] * 5).save(path)
    assert main(["solve", "--graph", str(path), "--budget", "10", "--solver", "plain"]) == 2
    err = capsys.readouterr().err
    assert "smallest feasible budget" in err


def test_bad_graph_file_exits_2(tmp_path, capsys):
    path = tmp_path / "g.json"
    path.write_text('{"nodes": [{"id": "a", "op": "x", "mem": -1}], "edges": []}')
    assert main(["min-budget", "--graph", str(path), "--solver", "plain"]) == 2
    assert "negative cost" in capsys.readouterr().err
