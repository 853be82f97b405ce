from pathlib import Path

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


def _plans_on(graph: Graph, solvers: list[str]):
    from lightning_remat.solvers import get_solver, plain_plan

    budget = int(0.9 * plain_plan(graph).predicted_peak_bytes)
    return [get_solver(solver)(graph, budget) for solver in solvers]


def test_simulate_scores_each_plan_with_the_simulator_not_the_file(tmp_path, capsys, monkeypatch):
    """`simulate` gives each plan's peak as ``simulate`` computes it and its extra time as
    ``make_plan`` gives every solver's plan, even where the file states other numbers."""
    import io
    import json

    from lightning_remat.solvers import make_plan, simulate

    data = Path(__file__).parent / "data" / "resnet50_224.json"
    graph = Graph.load(data)
    plans = _plans_on(graph, ["chen", "feng", "kusumoto-mc", "plain"])
    assert any(p.count("recompute") for p in plans)
    wrong = plans[0].to_dict() | {"predicted_peak_bytes": 1, "predicted_extra_seconds": 123.0}
    lines = tmp_path / "plans.jsonl"
    lines.write_text("\n".join([json.dumps(wrong), *(p.to_json() for p in plans[1:])]) + "\n\n")
    expected = [(simulate(graph, p).peak_bytes, make_plan(graph, p.stages, p.solver).predicted_extra_seconds)
                for p in plans]
    assert main(["simulate", "--graph", str(data), "--plans", str(lines), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["solver"] for r in rows] == ["chen", "feng", "kusumoto-mc", "plain"]
    assert [(r["predicted_peak_bytes"], r["predicted_extra_seconds"]) for r in rows] == expected
    assert rows[-1]["predicted_extra_seconds"] == 0.0 and expected[0][1] > 0

    # One plan as `solve --json` writes it (indented over many lines), from a file or stdin.
    one = tmp_path / "plan.json"
    assert main(["solve", "--graph", str(data), "--budget", "90%", "--solver", "feng", "--json"]) == 0
    one.write_text(capsys.readouterr().out)
    assert main(["simulate", "--graph", str(data), "--plans", str(one), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_peak_bytes"] == expected[1][0]
    monkeypatch.setattr("sys.stdin", io.StringIO(one.read_text()))
    assert main(["simulate", "--graph", str(data), "--plans", "-"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert "predicted_peak_bytes" in text[0] and str(expected[1][0]) in text[1]

    # The table says where the file's own numbers differ from the simulator's.
    assert main(["simulate", "--graph", str(data), "--plans", str(lines)]) == 0
    first = capsys.readouterr().out.splitlines()[1]
    assert "peak 1" in first and "extra 123 s" in first and str(expected[0][0]) in first


def test_help_loads_neither_torch_nor_lightning_and_lists_every_solver():
    """`lightning-remat --help` in a fresh interpreter imports no torch or Lightning (it
    answers in a fraction of a second), and the solver names it lists are the registry's."""
    import subprocess
    import sys

    from lightning_remat.cli import SOLVER_NAMES
    from lightning_remat.solvers import SOLVERS

    assert sorted(SOLVER_NAMES) == sorted(SOLVERS)
    probe = ("import sys\nfrom lightning_remat.cli import main\n"
             "for argv in (['--help'], ['solve', '--help'], ['tune', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "kusumoto-tc" in done.stdout


def test_an_unknown_solver_is_refused_with_the_registered_names(tmp_path, capsys):
    import pytest

    path = tmp_path / "g.json"
    Graph.chain([100] * 5).save(path)
    with pytest.raises(SystemExit) as exit_:
        main(["solve", "--graph", str(path), "--budget", "100%", "--solver", "kusumoto"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'kusumoto' is not a solver" in err and "kusumoto-tc" in err


def test_a_plan_logged_for_tensorboard_reads_in_a_terminal_as_format_plan_prints_it():
    """`lightning-remat report` reads the plan table TensorBoard holds (Markdown) and prints
    it as `solve` does: the same facts, stages and notes, aligned for a terminal."""
    from lightning_remat.report import format_plan, plan_text_for_terminal
    from lightning_remat.solvers import get_solver, plain_plan

    graph = Graph.load(Path(__file__).parent / "data" / "resnet50_224.json")
    budget = int(0.7 * plain_plan(graph).predicted_peak_bytes)
    plan = get_solver("kusumoto-mc")(graph, budget)
    assert plan.count("recompute") and plan.notes
    logged = format_plan(graph, plan, budget_bytes=budget, markdown=True)
    assert plan_text_for_terminal(logged) == format_plan(graph, plan, budget_bytes=budget)
    assert plan_text_for_terminal("some other text") == "some other text"
