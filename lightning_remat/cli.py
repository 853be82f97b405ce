"""``lightning-remat``: profile a model, solve a graph, find the smallest budget, score plans.

Every error is one line on stderr that names the input and what is accepted, with exit code
2: arguments are checked by their argparse types, and the failures a command can expect
(unreadable files, a model that cannot be loaded, an infeasible budget) are caught in
:func:`main`. Each command imports what it needs when it runs, so ``--help`` and the
parser load neither torch nor Lightning (the package's own import loads neither either).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_remat.budget import ACCEPTED_FORMS, format_bytes, validate_budget
from lightning_remat.errors import RematError, RematInfeasibleError


class UsageError(Exception):
    """An input the command cannot use; its message names the input and what is accepted."""


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block), exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an int >= 1")
    return value


def input_shape(text: str) -> tuple[int, ...]:
    """A per-sample shape, ``"3,224,224"``."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(size < 1 for size in shape):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape; give the per-sample sizes (ints >= 1) separated by commas, "
            "such as 3,224,224 or 128")
    return shape


def budget_arg(text: str) -> str:
    """A budget string, kept as the library reads it (:func:`~lightning_remat.budget.parse_budget`):
    ``"4096"`` bytes, ``"0.5"`` a fraction, ``"4GiB"``, ``"60%"``."""
    try:
        validate_budget(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a budget; accepted: {ACCEPTED_FORMS}") from None
    return text


SOLVER_NAMES = ("auto", "chen", "chen-greedy", "dynprog", "feng", "greedy", "hong-cubic",
                "hong-linear", "kusumoto-exact-mc", "kusumoto-exact-tc", "kusumoto-mc",
                "kusumoto-tc", "lower-bound", "plain", "vdnn")
"""The registry's names (:data:`lightning_remat.solvers.SOLVERS`, which a test holds this to),
written out so that ``--help`` imports no solver and so no torch."""
SOLVER_HELP = f"one of {', '.join(SOLVER_NAMES)} (default: auto)"


def solver_name(text: str) -> str:
    """A registered solver's name, checked against the registry itself."""
    from lightning_remat.solvers import SOLVERS

    if text not in SOLVERS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a solver; choose from {', '.join(sorted(SOLVERS))}")
    return text


def graph_file(text: str) -> Path:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory; give a graph JSON file (as 'lightning-remat profile' writes)")
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{text!r}: no such file; give a graph JSON file (as 'lightning-remat profile' writes)")
    return path


def device_arg(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, checked against this machine."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; accepted: cpu, cuda, cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has no CUDA device torch can use; accepted here: cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {count} CUDA device(s); accepted: cuda:0 to cuda:{count - 1}")
    return text


def plans_file(text: str) -> Path:
    """A file of plans, or ``-`` for standard input."""
    path = Path(text)
    accepted = ("give a file of plans as 'lightning-remat solve --json' writes them (one plan, "
                "or one plan per line), or - for standard input")
    if text != "-" and path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; {accepted}")
    if text != "-" and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file; {accepted}")
    return path


PLANS_ACCEPTED = ("give one plan as 'lightning-remat solve --json' writes it, or JSON lines of "
                  "such plans (one object per line)")


def load_plans(path: Path) -> list[tuple[str, Any]]:
    """The plans in ``path`` (``-``: standard input): one plan JSON object (over any number of
    lines, as ``solve --json`` writes it), or one plan object per line; UsageError otherwise,
    naming the line. Each plan comes with where it was read (``""`` or ``" line N"``)."""
    import json

    from lightning_remat.solvers.plan import Plan

    name = "standard input" if str(path) == "-" else str(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text()
    except UnicodeDecodeError as exc:
        raise UsageError(f"--plans {name} is not text ({_one_line(exc)}); {PLANS_ACCEPTED}") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # not one document: JSON lines, read below
    except (ValueError, RecursionError) as exc:  # a number too long to read, nesting too deep
        raise UsageError(f"--plans {name} is not JSON ({_one_line(exc)}); {PLANS_ACCEPTED}") from None
    if whole is not None:
        documents: list[tuple[str, Any]] = [("", whole)]
    else:
        documents = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                documents.append((f" line {number}", json.loads(line)))
            except (ValueError, RecursionError) as exc:
                raise UsageError(f"--plans {name} line {number} is not JSON ({_one_line(exc)}); "
                                 f"{PLANS_ACCEPTED}") from None
    if not documents:
        raise UsageError(f"--plans {name} holds no plan; {PLANS_ACCEPTED}")
    plans = []
    for where, data in documents:
        try:
            plans.append((where, Plan.from_dict(data)))
        except (ValueError, KeyError, TypeError, OverflowError) as exc:
            raise UsageError(f"--plans {name}{where} is not a plan ({_one_line(exc)}); "
                             f"{PLANS_ACCEPTED}") from None
    return plans


def load_graph(path: str | Path) -> Any:
    """The graph in ``path``; UsageError when it is not one, or has no vertices."""
    from lightning_remat.graph.ir import Graph

    try:
        graph = Graph.load(path)
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise UsageError(f"--graph {path} is nested too deep to be a graph; give a file as "
                         "'lightning-remat profile' writes (docs/design.md section 3)") from None
    except (ValueError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as exc:
        raise UsageError(f"--graph {path} is not a graph JSON ({_one_line(exc)}); give a file "
                         "as 'lightning-remat profile' writes (docs/design.md section 3)") from None
    if len(graph) == 0:
        raise UsageError(f"--graph {path} has no vertices; give the graph of a model with at least "
                         "one operation")
    return graph


def load_model(spec: str) -> Any:
    """A torchvision model by name (``resnet50``) or ``package.module:factory``: an
    ``nn.Module``, or UsageError."""
    import torch

    if ":" in spec:
        module_name, attr = spec.split(":", 1)
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise UsageError(f"cannot load {spec!r}: {_one_line(exc)}; give module.path:factory "
                             "with the module importable from here") from None
        try:
            model = factory()
        except Exception as exc:
            raise UsageError(f"{spec}() raised {type(exc).__name__}: {_one_line(exc)}; the factory "
                             "must build the model without arguments") from None
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"{spec}() returned {type(model).__name__}, not a torch.nn.Module; the "
                             "factory must return the model")
        return model
    try:
        import torchvision
    except ImportError:
        raise UsageError(
            f"{spec!r} names a torchvision model but torchvision is not installed "
            "(pip install 'lightning-remat[vision]'), or give module.path:factory"
        ) from None
    try:
        return torchvision.models.get_model(spec)
    except ValueError as exc:
        raise UsageError(f"{_one_line(exc)}; or give module.path:factory") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from lightning_remat.graph.profile import profile_module

    model = load_model(args.model)
    shape = [args.batch_size, *args.input_shape]
    if args.dtype == "long":
        example = torch.randint(0, args.vocab, shape, device=args.device)
    else:
        example = torch.randn(*shape, device=args.device)
    model = model.to(args.device)
    graph = profile_module(model, example, safe=args.safe)
    graph.save(args.out)
    peak = graph.meta.plain_peak_bytes
    extra = f", measured plain peak {format_bytes(peak)}" if peak else ""
    print(f"wrote {args.out}: {len(graph)} vertices, {len(graph.edges)} edges{extra}")
    return 0


def _cmd_solve(args: argparse.Namespace) -> int:
    from lightning_remat.budget import Budget
    from lightning_remat.solvers import fits, get_solver, min_budget
    from lightning_remat.solvers.policy import plain_peak_bytes

    graph = load_graph(args.graph)
    # A fraction is of the plain peak the graph's profile measured, as remat() takes it.
    budget = Budget(args.budget).resolve(lambda: plain_peak_bytes(graph))
    plan = get_solver(args.solver)(graph, budget)
    if not fits(plan, budget):
        raise RematInfeasibleError(budget or 0, min_budget(graph, args.solver), args.solver)
    if args.json:
        print(plan.to_json(indent=1))
    else:
        from lightning_remat.report import format_plan

        print(format_plan(graph, plan, budget_bytes=budget))
    return 0


def _cmd_min_budget(args: argparse.Namespace) -> int:
    from lightning_remat.solvers import min_budget

    graph = load_graph(args.graph)
    nbytes = min_budget(graph, args.solver)
    print(f"{nbytes}\t{format_bytes(nbytes)}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Each plan's peak and extra time as the package defines them: the plan's stages scored
    again by :func:`~lightning_remat.solvers.scoring.make_plan` (the simulator's peak and
    the recomputation time every solver's plan is given), whatever the file states."""
    import json

    from lightning_remat.solvers.scoring import make_plan

    graph = load_graph(args.graph)
    name = "standard input" if str(args.plans) == "-" else str(args.plans)
    scored = []
    for index, (where, plan) in enumerate(load_plans(args.plans)):
        try:
            plan.validate(graph)  # before make_plan, which orders stages by graph position
        except ValueError as exc:
            raise UsageError(f"--plans {name}{where} is not a plan of --graph {args.graph} "
                             f"({_one_line(exc)}); give plans solved on this graph") from None
        again = make_plan(graph, plan.stages, plan.solver)
        scored.append((index, plan, again))
    if args.json:
        for index, plan, again in scored:
            print(json.dumps({"plan": index, "solver": plan.solver,
                              "predicted_peak_bytes": int(again.predicted_peak_bytes),
                              "predicted_extra_seconds": float(again.predicted_extra_seconds)}))
        return 0
    print(f"{'plan':>4}  {'solver':<24} {'stages':>6} {'recomputed':>10} "
          f"{'predicted_peak_bytes':>20} {'':>11} {'predicted_extra_seconds':>23}  as the file states")
    for index, plan, again in scored:
        stated = []
        if plan.predicted_peak_bytes != again.predicted_peak_bytes:
            stated.append(f"peak {plan.predicted_peak_bytes}")
        if abs(plan.predicted_extra_seconds - again.predicted_extra_seconds) > 1e-9 * max(
                1.0, abs(again.predicted_extra_seconds)):
            stated.append(f"extra {plan.predicted_extra_seconds:.6g} s")
        print(f"{index:>4}  {plan.solver:<24} {len(plan.stages):>6} {plan.count('recompute'):>10} "
              f"{again.predicted_peak_bytes:>20} {format_bytes(again.predicted_peak_bytes):>11} "
              f"{again.predicted_extra_seconds:>23.6g}  {', '.join(stated) or 'the same'}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from lightning_remat.report import find_event_dirs, plan_text_for_terminal, read_run, write_png

    report = read_run(args.run_dir)
    runs = len(find_event_dirs(args.run_dir))
    print(f"run: {report.event_dir}" + (f" (the latest with a timeline of {runs} event folders under "
                                        f"{args.run_dir}; give one of them to read another)" if runs > 1 else ""))
    out = write_png(report, args.out or report.event_dir / "remat_timeline.png")
    print(plan_text_for_terminal(report.plan_text) if report.plan_text else "(no plan table logged)")
    if report.measured:
        print(f"\ntimeline peak: measured {format_bytes(max(report.measured))}, "
              f"predicted {format_bytes(max(report.predicted))}")
    print(f"timeline written to {out}")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    import pytorch_lightning as pl

    from lightning_remat.lightning.batch_size import find_max_batch_size
    from lightning_remat.lightning.synthetic import SyntheticTask

    if not args.device.startswith("cuda") and not args.budget:
        raise UsageError("tune on CPU needs --budget (bytes or '512MiB'): nothing raises "
                         "out-of-memory there, so only the budget bounds the batch size")
    if args.init_val > args.max_val:
        raise UsageError(f"--init-val {args.init_val} is above --max-val {args.max_val}; lower "
                         "--init-val or raise --max-val")
    model = load_model(args.model)
    if not isinstance(model, pl.LightningModule):
        model = SyntheticTask(model, args.input_shape, batch_size=args.init_val, dtype=args.dtype,
                              vocab=args.vocab)
    cuda = args.device.startswith("cuda")
    index = int(args.device.split(":")[1]) if cuda and ":" in args.device else 0
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=[index] if cuda else 1, max_epochs=1,
        default_root_dir=args.root_dir, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False,
    )
    from pytorch_lightning.utilities.exceptions import MisconfigurationException

    try:
        report = find_max_batch_size(
            trainer, model, memory_budget=args.budget, solver=args.solver,
            batch_arg_name=args.batch_arg_name, init_val=args.init_val, max_val=args.max_val,
            steps_per_trial=args.steps_per_trial, max_trials=args.max_trials,
            granularity=args.granularity, compare_plain=not args.no_plain, storage=args.storage,
            progress_bar=not args.no_progress,
        )
    except MisconfigurationException as exc:  # e.g. no attribute named --batch-arg-name
        raise UsageError(f"{args.model}: {_one_line(exc)}") from None
    print(report.table())
    return 0 if report.batch_size else 2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lightning-remat", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="trace and profile a model, write its graph JSON")
    p.add_argument("model", help="torchvision model name (resnet50) or module.path:factory")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--input-shape", type=input_shape, default="3,224,224",
                   help="per-sample shape, comma separated")
    p.add_argument("--dtype", choices=["float", "long"], default="float",
                   help="long: integer token ids in [0, --vocab)")
    p.add_argument("--vocab", type=positive_int, default=1000)
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--safe", action="store_true", help="memory-safe profiling (every stage recomputed)")
    p.add_argument("--out", "-o", default="graph.json")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("solve", help="plan a graph for a budget")
    p.add_argument("--graph", type=graph_file, required=True)
    p.add_argument("--budget", type=budget_arg, required=True,
                   help="bytes, '4GiB', '512MB', or '60%%' (0.6) of the plain peak the graph's profile "
                        "measured (as remat() takes it; simulated where none was measured)")
    p.add_argument("--solver", default="auto", type=solver_name, help=SOLVER_HELP)
    p.add_argument("--json", action="store_true", help="print the plan JSON")
    p.set_defaults(func=_cmd_solve)

    p = sub.add_parser("min-budget", help="smallest budget a solver reaches on a graph")
    p.add_argument("--graph", type=graph_file, required=True)
    p.add_argument("--solver", default="auto", type=solver_name, help=SOLVER_HELP)
    p.set_defaults(func=_cmd_min_budget)

    p = sub.add_parser("simulate", help="each plan's predicted peak and extra time on a graph")
    p.add_argument("--graph", type=graph_file, required=True)
    p.add_argument("--plans", type=plans_file, required=True,
                   help="one plan as 'solve --json' writes it, or JSON lines of plans; - reads stdin")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per plan: plan, solver, predicted_peak_bytes, "
                   "predicted_extra_seconds")
    p.set_defaults(func=_cmd_simulate)

    p = sub.add_parser("report", help="timeline PNG and plan table of a run's TensorBoard logs")
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default: beside the event file)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("tune", help="largest batch size that fits a budget, plain and with remat")
    p.add_argument("model", help="torchvision model name, or module.path:factory (an nn.Module, or a "
                   "LightningModule with its own train_dataloader and batch size attribute)")
    p.add_argument("--input-shape", type=input_shape, default="3,224,224",
                   help="per-sample shape, comma separated")
    p.add_argument("--dtype", choices=["float", "long"], default="float")
    p.add_argument("--vocab", type=positive_int, default=1000)
    p.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--budget", type=budget_arg, help="bytes or '6GiB' (required on CPU; default on CUDA: free memory less 10%%)")
    p.add_argument("--solver", default="auto", type=solver_name, help=SOLVER_HELP)
    p.add_argument("--batch-arg-name", default="batch_size")
    p.add_argument("--init-val", type=positive_int, default=2)
    p.add_argument("--max-val", type=positive_int, default=8192)
    p.add_argument("--steps-per-trial", type=positive_int, default=3)
    p.add_argument("--max-trials", type=positive_int, default=25)
    p.add_argument("--granularity", type=positive_int, default=1)
    p.add_argument("--no-plain", action="store_true", help="skip plain training's search")
    p.add_argument("--root-dir", default=".", help="where lightning_remat_cache/batch_size.db goes")
    p.add_argument("--storage", help="Optuna storage URL (default: SQLite under --root-dir)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_tune)
    return parser


_EXPECTED: tuple[type[BaseException], ...] = (
    UsageError, RematError, ValueError, OSError, OverflowError, NotImplementedError,
)
"""Failures a command expects (bad files, unusable models, infeasible budgets): one line."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command: Callable[[argparse.Namespace], int] = args.func
    try:
        return int(command(args) or 0)
    except _EXPECTED as exc:
        kind = "" if isinstance(exc, (UsageError, RematInfeasibleError, ValueError)) else f"{type(exc).__name__}: "
        print(f"lightning-remat {args.command}: error: {kind}{_one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
