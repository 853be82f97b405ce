"""``lightning-remat``: profile a model, solve a graph, find the smallest budget."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lightning_remat.budget import format_bytes
from lightning_remat.errors import RematError, RematInfeasibleError


def load_model(spec: str):
    """A torchvision model by name (``resnet50``) or ``package.module:factory``."""
    if ":" in spec:
        module_name, attr = spec.split(":", 1)
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise SystemExit(f"error: cannot load {spec!r}: {exc}") from exc
        return factory()
    try:
        import torchvision
    except ImportError:
        raise SystemExit(
            f"error: {spec!r} names a torchvision model but torchvision is not installed "
            "(pip install 'lightning-remat[vision]'), or give module.path:factory"
        ) from None
    try:
        return torchvision.models.get_model(spec)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc


def _cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from lightning_remat.graph.profile import profile_module

    model = load_model(args.model)
    shape = [args.batch_size, *[int(s) for s in args.input_shape.split(",")]]
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
    from lightning_remat.budget import parse_budget
    from lightning_remat.graph.ir import Graph
    from lightning_remat.solvers import fits, get_solver, min_budget, plain_plan

    graph = Graph.load(args.graph)
    budget = parse_budget(args.budget, plain_plan(graph).predicted_peak_bytes)
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
    from lightning_remat.graph.ir import Graph
    from lightning_remat.solvers import min_budget

    graph = Graph.load(args.graph)
    nbytes = min_budget(graph, args.solver)
    print(f"{nbytes}\t{format_bytes(nbytes)}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from lightning_remat.report import read_run, write_png

    report = read_run(args.run_dir)
    out = write_png(report, args.out or report.event_dir / "remat_timeline.png")
    print(report.plan_text or "(no plan table logged)")
    if report.measured:
        print(f"\ntimeline maximum: measured {format_bytes(max(report.measured))}, "
              f"predicted {format_bytes(max(report.predicted))}")
    print(f"timeline written to {out}")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    import pytorch_lightning as pl

    from lightning_remat.lightning.batch_size import find_max_batch_size
    from lightning_remat.lightning.synthetic import SyntheticTask

    if not args.device.startswith("cuda") and not args.budget:
        raise ValueError("tune on CPU needs --budget (bytes or '512MiB'): nothing raises "
                         "out-of-memory there, so only the budget bounds the batch size")
    model = load_model(args.model)
    if not isinstance(model, pl.LightningModule):
        shape = tuple(int(s) for s in args.input_shape.split(","))
        model = SyntheticTask(model, shape, batch_size=args.init_val, dtype=args.dtype, vocab=args.vocab)
    cuda = args.device.startswith("cuda")
    index = int(args.device.split(":")[1]) if cuda and ":" in args.device else 0
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=[index] if cuda else 1, max_epochs=1,
        default_root_dir=args.root_dir, logger=False, enable_checkpointing=False,
        enable_model_summary=False, enable_progress_bar=False,
    )
    budget = int(args.budget) if args.budget and args.budget.isdigit() else args.budget
    report = find_max_batch_size(
        trainer, model, memory_budget=budget, solver=args.solver, batch_arg_name=args.batch_arg_name,
        init_val=args.init_val, max_val=args.max_val, steps_per_trial=args.steps_per_trial,
        max_trials=args.max_trials, granularity=args.granularity, compare_plain=not args.no_plain,
        storage=args.storage, progress_bar=not args.no_progress,
    )
    print(report.table())
    return 0 if report.batch_size else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-remat", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="trace and profile a model, write its graph JSON")
    p.add_argument("model", help="torchvision model name (resnet50) or module.path:factory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-shape", default="3,224,224", help="per-sample shape, comma separated")
    p.add_argument("--dtype", choices=["float", "long"], default="float",
                   help="long: integer token ids in [0, --vocab)")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--safe", action="store_true", help="memory-safe profiling (every stage recomputed)")
    p.add_argument("--out", "-o", default="graph.json")
    p.set_defaults(func=_cmd_profile)

    from lightning_remat.solvers import SOLVERS

    p = sub.add_parser("solve", help="plan a graph for a budget")
    p.add_argument("--graph", required=True)
    p.add_argument("--budget", required=True, help="bytes, '4GiB', '512MB' or '60%%' of the plain peak")
    p.add_argument("--solver", default="auto", choices=sorted(SOLVERS))
    p.add_argument("--json", action="store_true", help="print the plan JSON")
    p.set_defaults(func=_cmd_solve)

    p = sub.add_parser("min-budget", help="smallest budget a solver reaches on a graph")
    p.add_argument("--graph", required=True)
    p.add_argument("--solver", default="auto", choices=sorted(SOLVERS))
    p.set_defaults(func=_cmd_min_budget)

    p = sub.add_parser("report", help="timeline PNG and plan table of a run's TensorBoard logs")
    p.add_argument("run_dir")
    p.add_argument("--out", help="PNG path (default: beside the event file)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser("tune", help="largest batch size that fits a budget, plain and with remat")
    p.add_argument("model", help="torchvision model name, or module.path:factory (an nn.Module, or a "
                   "LightningModule with its own train_dataloader and batch size attribute)")
    p.add_argument("--input-shape", default="3,224,224", help="per-sample shape, comma separated")
    p.add_argument("--dtype", choices=["float", "long"], default="float")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--budget", help="bytes or '6GiB' (required on CPU; default on CUDA: free memory less 10%%)")
    p.add_argument("--solver", default="auto", choices=sorted(SOLVERS))
    p.add_argument("--batch-arg-name", default="batch_size")
    p.add_argument("--init-val", type=int, default=2)
    p.add_argument("--max-val", type=int, default=8192)
    p.add_argument("--steps-per-trial", type=int, default=3)
    p.add_argument("--max-trials", type=int, default=25)
    p.add_argument("--granularity", type=int, default=1)
    p.add_argument("--no-plain", action="store_true", help="skip plain training's search")
    p.add_argument("--root-dir", default=".", help="where lightning_remat/batch_size.db goes")
    p.add_argument("--storage", help="Optuna storage URL (default: SQLite under --root-dir)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_tune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RematInfeasibleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RematError, ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
