"""Every error of the command line is one line on stderr that names the input and what is
accepted, with exit code 2, never a traceback."""

from __future__ import annotations

import json
import sys

import pytest

from lightning_remat.cli import main
from lightning_remat.graph.ir import Graph
from lightning_remat.solvers import plain_plan


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors exit from parse_args
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.err


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "huge.json").write_text('{"nodes": [{"id": "a", "op": "x", "mem": 1e400}], "edges": []}')
    (tmp_path / "empty.json").write_text('{"nodes": []}')
    (tmp_path / "garbage.json").write_bytes(b"\xff\xfe not json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    chain = Graph.chain([100] * 3).to_dict()
    for name, where, key, value in [
        ("alias_cycle.json", "meta", "aliases", {"v1": "v2", "v2": "v1"}),
        ("negative_input.json", "meta", "input_bytes", -64),
        ("negative_grad.json", "meta", "param_grad_bytes", {"v0": -8}),
        ("infinite_step.json", "meta", "step_seconds", float("inf")),
        ("infinite_time.json", "node", "t_fwd", float("inf")),
        ("nan_time.json", "node", "t_bwd", float("nan")),
    ]:
        data = json.loads(json.dumps(chain))
        (data["meta"] if where == "meta" else data["nodes"][1])[key] = value
        (tmp_path / name).write_text(json.dumps(data))  # json writes Infinity and NaN
    Graph.chain([100] * 5).save(tmp_path / "g.json")
    plan = plain_plan(Graph.chain([100] * 5)).to_json()
    (tmp_path / "plan_of_8.json").write_text(plain_plan(Graph.chain([100] * 8)).to_json(indent=1))
    (tmp_path / "not_a_plan.json").write_text('{"stages": []}')
    (tmp_path / "plans.jsonl").write_text(f"{plan}\n{plan[:40]}\n")
    (tmp_path / "no_plans.jsonl").write_text("\n\n")
    (tmp_path / "bad_action.json").write_text(plan.replace('"keep"', '"discard"'))
    (tmp_path / "nested_ids.json").write_text(plan.replace('["v0", "v1", "v2", "v3", "v4"]',
                                                           '[["v0"], "v1", "v2", "v3", "v4"]', 1))
    (tmp_path / "nan_extra.json").write_text(
        json.dumps({**json.loads(plan), "predicted_extra_seconds": float("nan")}))
    (tmp_path / "cli_factories.py").write_text(
        "import torch\n"
        "def number():\n    return 3\n"
        "def needs_args(width):\n    return torch.nn.Linear(width, width)\n"
        "def linear():\n    return torch.nn.Linear(4, 4)\n")
    sys.modules.pop("cli_factories", None)
    return tmp_path


CASES = [
    (["solve", "--graph", "a_dir", "--budget", "50%"], ["'a_dir' is a directory", "graph JSON file"]),
    (["min-budget", "--graph", "missing.json"], ["'missing.json': no such file"]),
    (["solve", "--graph", "huge.json", "--budget", "50%"], ["huge.json is not a graph JSON", "infinity"]),
    (["solve", "--graph", "garbage.json", "--budget", "50%"], ["garbage.json is not a graph JSON"]),
    (["solve", "--graph", "empty.json", "--budget", "50%"], ["empty.json has no vertices"]),
    (["min-budget", "--graph", "alias_cycle.json"], ["alias_cycle.json is not a graph JSON",
                                                     "'aliases'", "cycle"]),
    (["solve", "--graph", "alias_cycle.json", "--budget", "50%"], ["'aliases'", "cycle"]),
    (["min-budget", "--graph", "deep.json"], ["deep.json is nested too deep to be a graph"]),
    (["simulate", "--graph", "deep.json", "--plans", "plans.jsonl"], ["deep.json is nested too deep"]),
    (["min-budget", "--graph", "negative_input.json"], ["'input_bytes'", "-64", "must not be negative"]),
    (["min-budget", "--graph", "negative_grad.json"], ["'param_grad_bytes' entry 'v0'", "must not be negative"]),
    (["min-budget", "--graph", "infinite_step.json"], ["'step_seconds'", "finite"]),
    (["min-budget", "--graph", "infinite_time.json"], ["node 'v1'", "t_fwd=inf", "finite"]),
    (["min-budget", "--graph", "nan_time.json"], ["node 'v1'", "t_bwd=nan", "finite"]),
    (["solve", "--graph", "g.json", "--budget", "lots"], ["'lots' is not a budget", "accepted:"]),
    (["solve", "--graph", "g.json", "--budget", "0"], ["'0' is not a budget", "accepted:"]),
    (["solve", "--graph", "g.json", "--budget", "1.5"], ["'1.5' is not a budget", "'60%'", "'0.6'"]),
    (["solve", "--graph", "g.json", "--solver", "fastest", "--budget", "1"], ["'fastest'", "choose from"]),
    (["profile", "cli_factories:number"], ["cli_factories:number() returned int, not a torch.nn.Module"]),
    (["profile", "cli_factories:needs_args"], ["cli_factories:needs_args() raised TypeError",
                                               "without arguments"]),
    (["profile", "cli_factories:missing"], ["cannot load 'cli_factories:missing'"]),
    (["profile", "no_such_module:f"], ["cannot load 'no_such_module:f'"]),
    (["profile", "cli_factories:linear", "--batch-size", "0"], ["--batch-size: '0' must be an int >= 1"]),
    (["profile", "cli_factories:linear", "--input-shape", "3,x"], ["'3,x' is not a shape", "3,224,224"]),
    (["profile", "cli_factories:linear", "--device", "tpu"], ["'tpu' is not a device", "cpu, cuda"]),
    (["profile", "cli_factories:linear", "--input-shape", "4", "-o", "a_dir"], ["a_dir"]),
    (["tune", "cli_factories:linear", "--input-shape", "4"], ["needs --budget"]),
    (["tune", "cli_factories:linear", "--budget", "1MiB", "--init-val", "0"], ["--init-val: '0'"]),
    (["simulate", "--graph", "g.json", "--plans", "a_dir"], ["'a_dir' is a directory", "solve --json"]),
    (["simulate", "--graph", "g.json", "--plans", "missing.json"], ["'missing.json': no such file"]),
    (["simulate", "--graph", "g.json"], ["--plans"]),
    (["simulate", "--graph", "garbage.json", "--plans", "plans.jsonl"], ["garbage.json is not a graph JSON"]),
    (["simulate", "--graph", "g.json", "--plans", "garbage.json"], ["--plans garbage.json", "solve --json"]),
    (["simulate", "--graph", "g.json", "--plans", "not_a_plan.json"],
     ["--plans not_a_plan.json is not a plan", "missing ['stored'", "solve --json"]),
    (["simulate", "--graph", "g.json", "--plans", "bad_action.json"], ["'discard'", "is not a plan"]),
    (["simulate", "--graph", "g.json", "--plans", "nested_ids.json"],
     ["--plans nested_ids.json is not a plan", "list of vertex ids"]),
    (["simulate", "--graph", "g.json", "--plans", "nan_extra.json"],
     ["--plans nan_extra.json is not a plan", "predicted_extra_seconds=nan", "finite"]),
    (["simulate", "--graph", "g.json", "--plans", "plans.jsonl"], ["--plans plans.jsonl line 2 is not JSON"]),
    (["simulate", "--graph", "g.json", "--plans", "no_plans.jsonl"], ["no_plans.jsonl holds no plan"]),
    (["simulate", "--graph", "g.json", "--plans", "plan_of_8.json"],
     ["--plans plan_of_8.json is not a plan of --graph g.json", "unknown vertex 'v5'"]),
    (["report", "no_such_dir"], ["no_such_dir"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
]


@pytest.mark.parametrize("argv, words", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_each_error_is_one_line_naming_the_input_with_exit_code_2(files, capsys, argv, words):
    code, err = _run(argv, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("lightning-remat"), err
    for word in words:
        assert word in lines[0], err


def test_tune_on_cuda_without_a_gpu_says_so(files, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _run(["tune", "cli_factories:linear", "--device", "cuda"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'cuda': this machine has no CUDA device" in err and "accepted here: cpu" in err


def test_a_budget_written_as_a_fraction_is_a_fraction(files, capsys):
    # 0.5 is half the plain peak (as in the library), not 0 bytes.
    assert main(["solve", "--graph", "g.json", "--budget", "0.5", "--solver", "plain"]) == 2
    assert "no plan fits a budget of 350 B" in capsys.readouterr().err  # half of 700 B
    assert main(["solve", "--graph", "g.json", "--budget", "1.0", "--solver", "plain"]) == 0


def test_a_budget_string_means_the_same_in_the_library_and_on_the_command_line(files, capsys):
    from lightning_remat.budget import parse_budget

    peak = plain_plan(Graph.load("g.json")).predicted_peak_bytes
    assert parse_budget("0.5", peak) == parse_budget(0.5, peak) == peak // 2
    assert main(["solve", "--graph", "g.json", "--budget", "0.5", "--solver", "plain"]) == 2
    assert f"no plan fits a budget of {peak // 2} B" in capsys.readouterr().err


def test_faulty_graphs_print_no_numpy_warnings(files, capsys, recwarn):
    for name in ("infinite_time.json", "nan_time.json", "infinite_step.json"):
        code, err = _run(["min-budget", "--graph", name], capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    # numpy's overflow and invalid-value warnings are RuntimeWarnings.
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)], [
        str(w.message) for w in recwarn]


@pytest.mark.slow
def test_tune_with_an_unknown_batch_attribute_is_one_line(files, capsys):
    code, err = _run(["tune", "cli_factories:linear", "--input-shape", "4", "--budget", "1MiB",
                      "--batch-arg-name", "no_such_attribute", "--no-progress"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no_such_attribute" in err and "Traceback" not in err
