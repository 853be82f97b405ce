"""Every error of the command line is one line on stderr that names the input and what is
accepted, with exit code 2, never a traceback."""

from __future__ import annotations

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
    Graph.chain([100] * 5).save(tmp_path / "g.json")
    plan = plain_plan(Graph.chain([100] * 5)).to_json()
    (tmp_path / "plan_of_8.json").write_text(plain_plan(Graph.chain([100] * 8)).to_json(indent=1))
    (tmp_path / "not_a_plan.json").write_text('{"stages": []}')
    (tmp_path / "plans.jsonl").write_text(f"{plan}\n{plan[:40]}\n")
    (tmp_path / "no_plans.jsonl").write_text("\n\n")
    (tmp_path / "bad_action.json").write_text(plan.replace('"keep"', '"discard"'))
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
    (["solve", "--graph", "g.json", "--budget", "lots"], ["'lots' is not a budget", "accepted:"]),
    (["solve", "--graph", "g.json", "--budget", "0"], ["'0' is not a budget", "accepted:"]),
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


@pytest.mark.slow
def test_tune_with_an_unknown_batch_attribute_is_one_line(files, capsys):
    code, err = _run(["tune", "cli_factories:linear", "--input-shape", "4", "--budget", "1MiB",
                      "--batch-arg-name", "no_such_attribute", "--no-progress"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "no_such_attribute" in err and "Traceback" not in err
