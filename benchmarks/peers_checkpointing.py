"""Against the checkpointing users already have: timm's ``set_grad_checkpointing(True)`` and
Hugging Face's ``gradient_checkpointing_enable()``, and ``remat`` with the budget set to the
peer's measured peak, in the same harness and the same run.

Models: the zoo's timm ViT, Swin and EfficientNet (tests/test_zoo_vision.py, random init,
the loss the sum of the logits) and the zoo's transformers with their configs' defaults (the
cache, the attention implementation and dropout as shipped), each trained on its own
``.loss`` from labels as a fine-tune does: GPT-2, Qwen2 and T5 as tests/test_zoo_transformers.py
builds them (labels the input ids; T5 from ``input_ids`` and ``labels`` only, its decoder's
start token 0 as T5's checkpoints have it, the config class names none), BERT's masked LM
as tests/hf_architectures.py builds it (batch 8 of 64 tokens, padded, labels -100 on the
padding) and the Llama of examples/hf_finetune.py (4 layers, hidden 128, batch 8 of 128
tokens). Hugging Face's peer is ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
{"use_reentrant": False})`` (the kwargs the installed transformers defaults to; a
version whose default differs is named in the record's ``hf_default_kwargs``).

Harness as in ``benchmarks/run.py``: every figure from a fresh process; the peak is one
step's peak above what was live before it (``lightning_remat.measure.peak.peak_bytes``,
gradients freed before the step so allocating them is part of it); the time is the median
of ``--repeats`` steps after a warm-up, alternating with plain steps in the same process
(*time/plain* is the ratio of the medians). Our smallest feasible budget is
``min_budget(graph, "auto")`` on the graph ``remat`` profiled (or a refusal's
``min_budget_bytes``). ``remat`` runs at the peer's measured peak and at 50% of the plain
step's profiled peak; *held* is the measured peak within the budget.

``--architectures`` instead takes every architecture of tests/hf_architectures.py (default
configs, batch 8 of 128 tokens, the model's own loss) and measures the plain step's peak,
HF checkpointing's peak, our smallest budget and our peak at HF's peak (no times);
architectures whose model does not support gradient checkpointing are reported as such,
with our smallest budget beside their plain peak.

    python benchmarks/peers_checkpointing.py            # every model; prints the table
    python benchmarks/peers_checkpointing.py --models vit gpt2
    python benchmarks/peers_checkpointing.py --architectures --tag architectures-cpu

``--head-to-head N`` also times plain training, the peer and ``remat`` at the peer's peak in
one process, alternating step by step for N rounds, so that the load of other work on the
machine meets all three alike (with ``--update``, only that is added to a tag's rows).

Results go to ``benchmarks/results/peers/<tag>.json``; ``benchmarks/render.py`` puts their
tables in ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "peers"
MiB = 2**20
VISION = ("vit", "swin", "efficientnet")
TRANSFORMERS = ("gpt2", "qwen2", "t5", "bert", "llama")
MODELS = VISION + TRANSFORMERS
ARCH_BATCH, ARCH_LENGTH = 8, 128
HF_KWARGS = {"use_reentrant": False}


def peer_of(name: str) -> str:
    return "timm set_grad_checkpointing" if name in VISION else "HF gradient_checkpointing_enable"


def capture_of(notes: list[str]) -> str:
    """How the planner captured the forward, from its plan's note ("capture: torch.fx, 71
    vertices": ``torch.fx``, ``torch.export (non-strict)``, or the submodule fallback)."""
    for note in notes:
        found = re.match(r"capture: (.+?), \d+ vertices", note)
        if found:
            return found.group(1)
    return "unknown"


def build(name: str) -> tuple[Any, Any]:
    """(model, input), seeded, in training mode: the input a tensor (vision) or the keyword
    arguments of a Hugging Face model with ``labels``. ``arch:<model_type>``: an architecture
    of tests/hf_architectures.py."""
    import torch

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    if name.startswith("arch:"):
        from tests.hf_architectures import build as build_architecture

        model, x = build_architecture(name[5:], batch=ARCH_BATCH, length=ARCH_LENGTH)
    elif name in ("gpt2", "qwen2", "t5"):
        from tests import test_zoo_transformers as zoo

        model, x = getattr(zoo, name)()
        if name == "t5":  # a fine-tune passes the targets; the decoder's inputs are shifted from them
            x = {"input_ids": x["input_ids"], "labels": x.pop("decoder_input_ids")}
            # T5Config's defaults name no start token to shift with; T5's own checkpoints use the pad's, 0.
            model.config.decoder_start_token_id = 0
        else:
            x = dict(x, labels=x["input_ids"])
    elif name == "bert":
        from tests.hf_architectures import build as build_architecture

        model, x = build_architecture("bert", batch=8, length=64)
    elif name == "llama":
        import transformers

        sys.path.insert(0, str(ROOT / "examples"))
        import hf_finetune as example

        config = transformers.LlamaConfig(
            vocab_size=example.VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=example.SEQUENCE)
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, example.VOCAB, (example.BATCH, example.SEQUENCE))
        x = {"input_ids": ids, "labels": ids}
    else:
        from tests.test_zoo_vision import ZOO

        model, x = ZOO[name]()
    return model.train(), x


def call(module: Any, x: Any) -> Any:
    return module(**x) if isinstance(x, dict) else module(x)


def step_loss(out: Any) -> Any:
    """A Hugging Face output's own ``loss`` (from labels); else the sum of the logits."""
    if getattr(out, "loss", None) is not None:
        return out.loss
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
    return logits.float().sum()


def head_to_head(name: str, budget: int, repeats: int) -> dict[str, Any]:
    """Step times of plain training, the peer and ``remat`` at ``budget`` in one process,
    alternating step by step (no peaks: those come from processes of their own): where
    other work shares the CPU, the three meet the same load."""
    import copy
    import warnings

    import torch

    import lightning_remat

    warnings.simplefilter("ignore")
    model, x = build(name)
    peer = copy.deepcopy(model)
    if hasattr(peer, "set_grad_checkpointing"):
        peer.set_grad_checkpointing(True)
    else:
        peer.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(HF_KWARGS))
    ours = lightning_remat.remat(copy.deepcopy(model), x, memory_budget=budget, loss_fn=step_loss)
    steps = {"plain": model, "peer": peer, "remat": ours}
    spent: dict[str, list[float]] = {key: [] for key in steps}
    for round_ in range(repeats + 1):  # the first round warms up
        for key, module in steps.items():
            for p in module.parameters():
                p.grad = None
            torch.manual_seed(1)
            t0 = time.perf_counter()
            step_loss(call(module, x)).backward()
            if round_:
                spent[key].append(time.perf_counter() - t0)
    return {f"{key}_step_seconds": statistics.median(times) for key, times in spent.items()}


def measure(name: str, method: str, budget: int | str | None, repeats: int) -> dict[str, Any]:
    """``method``: ``peer`` (the plain step's peak is measured here too), ``remat`` at
    ``budget`` (bytes or a fraction string; None: no limit, the plain plan) or ``both``
    (:func:`head_to_head`)."""
    if method == "both":
        return head_to_head(name, int(budget or 0), repeats)
    import warnings

    import torch

    import lightning_remat
    from lightning_remat.measure.peak import peak_bytes
    from lightning_remat.solvers import min_budget

    warnings.simplefilter("ignore")  # the deprecation and cache warnings, once per process
    model, x = build(name)
    row: dict[str, Any] = {}
    run = model
    if method == "peer":
        import copy

        def plain_only() -> None:
            torch.manual_seed(1)
            step_loss(call(model, x)).backward()

        plain_only()
        model.zero_grad(set_to_none=True)
        row["plain_peak_bytes"] = peak_bytes(plain_only)
        if hasattr(model, "set_grad_checkpointing"):
            run = copy.deepcopy(model)  # the switch is on the model: plain steps need one without
            run.set_grad_checkpointing(True)
        elif getattr(model, "supports_gradient_checkpointing", False):
            run = copy.deepcopy(model)
            run.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(HF_KWARGS))
        else:
            row["unsupported"] = True
            return row
    else:
        start = time.perf_counter()
        try:
            run = lightning_remat.remat(model, x, memory_budget=budget, loss_fn=step_loss)
            graph = run.graph
        except lightning_remat.RematInfeasibleError as refused:
            return {"infeasible": True, "min_budget_bytes": refused.min_budget_bytes,
                    "refusal": str(refused)[:600], "planning_seconds": time.perf_counter() - start}
        row.update(planning_seconds=time.perf_counter() - start, vertices=len(graph),
                   capture=capture_of(run.plan.notes), notes=list(run.plan.notes),
                   min_budget_bytes=min_budget(graph, "auto"), budget_bytes=run.budget_bytes,
                   predicted_peak_bytes=int(run.plan.predicted_peak_bytes),
                   margin_bytes=int(run.plan.margin_bytes), solver=run.plan.solver,
                   recomputed=run.plan.count("recompute"), stages=len(run.plan.stages))

    def step() -> None:
        torch.manual_seed(1)
        step_loss(call(run, x)).backward()

    def plain_step() -> None:
        torch.manual_seed(1)
        step_loss(call(model, x)).backward()

    def clear() -> None:
        for p in list(run.parameters()) + list(model.parameters()):
            p.grad = None

    step()
    clear()
    row["peak_bytes"] = peak_bytes(step)
    if repeats:
        times: dict[Any, list[float]] = {plain_step: [], step: []}
        for fn in times:  # one warm-up each
            clear()
            fn()
        for _ in range(repeats):
            for fn, spent in times.items():
                clear()
                t0 = time.perf_counter()
                fn()
                spent.append(time.perf_counter() - t0)
        row["step_seconds"] = statistics.median(times[step])
        row["plain_step_seconds"] = statistics.median(times[plain_step])
    return row


def spawn(name: str, method: str, budget: int | str | None, repeats: int, threads: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, method, str(budget or 0), str(repeats), str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]}


def _mib(b: float, plain: int) -> str:
    return f"{b / MiB:.2f} ({b / plain:.2f})"


def _at(ours: dict[str, Any], plain: int) -> str:
    """Our measured peak at a budget, whether the budget was accepted and held."""
    if "peak_bytes" in ours:
        held = "held" if ours["peak_bytes"] <= ours["budget_bytes"] else \
            f"**over by {(ours['peak_bytes'] - ours['budget_bytes']) / MiB:.2f}**"
        return f"{_mib(ours['peak_bytes'], plain)}, {held}"
    if ours.get("infeasible"):
        least = ours.get("min_budget_bytes")
        return "**refused**" + (f" (smallest {_mib(least, plain)})" if least else "")
    return f"error: {ours.get('error', 'not run')}"


def _together(row: dict[str, Any]) -> str:
    if "plain_step_seconds" not in row:
        return "-"
    plain = row["plain_step_seconds"]
    return f"{row['peer_step_seconds'] / plain:.2f}, {row['remat_step_seconds'] / plain:.2f}"


def table(record: dict[str, Any]) -> list[str]:
    """The Markdown table of one run of the models."""
    fifty = any("remat_50" in rows for rows in record["rows"].values())
    together = any("head_to_head" in rows for rows in record["rows"].values())
    out = ["| model | peer | plain peak MiB | peer peak MiB (/plain) | our smallest budget MiB (/plain) "
           "| our peak at the peer's peak MiB (/plain) "
           + ("| our peak at 50% MiB (/plain) " if fifty else "")
           + "| peer time/plain | our time/plain "
           + ("| one process: peer, ours /plain " if together else "") + "| our capture, vertices |",
           "|---|---|---:|---:|---:|---:|" + ("---:|" if fifty else "") + "---:|---:|"
           + ("---:|" if together else "") + "---|"]
    for name, rows in record["rows"].items():
        peer, ours = rows.get("peer", {}), rows.get("remat", {})
        if "peak_bytes" not in peer:
            out.append(f"| {name} | {peer_of(name)} | peer failed: {peer.get('error', '')} |"
                       + " |" * (6 + fifty + together))
            continue
        plain = peer["plain_peak_bytes"]
        least = ours.get("min_budget_bytes")
        least_cell = "-" if least is None else _mib(least, plain) + (
            "" if least <= peer["peak_bytes"] else " **above the peer's**")
        our_time = f"{ours['step_seconds'] / ours['plain_step_seconds']:.2f}" if "step_seconds" in ours else "-"
        capture = f"{ours['capture']}, {ours['vertices']}" if "capture" in ours else \
            (f"{rows['remat_50']['capture']}, {rows['remat_50']['vertices']}" if "capture" in rows.get("remat_50", {})
             else "-")
        out.append(f"| {name} | {peer_of(name)} | {plain / MiB:.2f} | {_mib(peer['peak_bytes'], plain)} | "
                   f"{least_cell} | {_at(ours, plain)} | "
                   + (f"{_at(rows.get('remat_50', {}), plain)} | " if fifty else "")
                   + f"{peer['step_seconds'] / peer['plain_step_seconds']:.2f} | {our_time} | "
                   + (f"{_together(rows.get('head_to_head', {}))} | " if together else "") + f"{capture} |")
    return out


def architectures_table(record: dict[str, Any]) -> list[str]:
    """The Markdown table of one ``--architectures`` run."""
    out = ["| architecture | plain peak MiB | HF checkpointing peak MiB (/plain) "
           "| our smallest budget MiB (/plain) | ours - HF MiB | our peak at HF's peak MiB (/plain) "
           "| our capture, vertices |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for name, rows in record["rows"].items():
        peer, ours = rows.get("peer", {}), rows.get("remat", {})
        if "plain_peak_bytes" not in peer:
            out.append(f"| {name} | peer failed: {peer.get('error', '')} | | | | | |")
            continue
        plain = peer["plain_peak_bytes"]
        least = ours.get("min_budget_bytes")
        least_cell = "-" if least is None else _mib(least, plain)
        capture = f"{ours['capture']}, {ours['vertices']}" if "capture" in ours else "-"
        if peer.get("unsupported"):
            out.append(f"| {name} | {plain / MiB:.2f} | no gradient checkpointing | {least_cell} | | "
                       f"{'' if 'peak_bytes' not in ours else _mib(ours['peak_bytes'], plain) + ' (no limit)'} "
                       f"| {capture} |")
            continue
        hf = peer["peak_bytes"]
        gap = "-" if least is None else f"{(least - hf) / MiB:+.2f}" + (" **above**" if least > hf else "")
        out.append(f"| {name} | {plain / MiB:.2f} | {_mib(hf, plain)} | {least_cell} | {gap} | "
                   f"{_at(ours, plain)} | {capture} |")
    return out


def render_section(results: Path = RESULTS) -> list[str]:
    """The section of RESULTS.md (empty without results)."""
    out: list[str] = []
    paths = sorted(results.glob("*.json")) if results.is_dir() else []
    records = sorted(((json.loads(path.read_text()), path) for path in paths), key=lambda pair: pair[0]["date"])
    for record, path in records:  # oldest first
        architectures = record.get("mode") == "architectures"
        title = ("Our smallest budget against Hugging Face checkpointing, every architecture" if architectures
                 else "Against timm and Hugging Face checkpointing")
        out += [f"## {title} ({path.stem})", "",
                f"{record['machine']}, torch {record['torch']}"
                + (f", transformers {record['transformers']}" if record.get("transformers") else "")
                + f", measured {record['date']} at commit "
                f"{record['commit']} by `{record.get('command', 'benchmarks/peers_checkpointing.py')}`"
                + (f" ({record['seconds']:.0f} s)" if "seconds" in record else "")
                + (f"; {record['note']}" if record.get("note") else "") + ". "
                + ("Each figure from a fresh process; HF's peak is `gradient_checkpointing_enable("
                   f"gradient_checkpointing_kwargs={record.get('hf_kwargs', HF_KWARGS)})`, ours the smallest "
                   "budget `remat` (solver `auto`) plans on the graph it profiled, and our measured peak "
                   "with HF's peak as the budget." if architectures else
                   "Each peer's measured peak is the budget of `remat` (solver `auto`), measured in the "
                   "same run and harness; ratios in brackets are to the plain step's peak, times are "
                   "to plain steps alternated in the same process; *held*: the measured peak within "
                   "the budget"
                   + ("; *one process*: plain, the peer and ours alternated step by step in one "
                      "process (`--head-to-head`)." if any("head_to_head" in rows for rows in
                                                            record["rows"].values()) else ".")), "",
                *(architectures_table(record) if architectures else table(record)), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=None, help=f"of {', '.join(MODELS)}; with --architectures, "
                   "model types of tests/hf_architectures.py")
    p.add_argument("--architectures", action="store_true",
                   help="every architecture of tests/hf_architectures.py: peaks and smallest budgets only")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads in each worker (0: torch's default)")
    p.add_argument("--head-to-head", type=int, default=0, metavar="N",
                   help="also time plain, the peer and remat at the peer's peak in one process, N rounds")
    p.add_argument("--no-fifty", action="store_true", help="skip remat at 50%% of the plain peak")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--update", action="store_true",
                   help="keep the tag's other rows, noting when and where these were measured")
    args = p.parse_args(argv)
    import torch

    from benchmarks.run import git_commit

    started = time.time()
    record: dict[str, Any] = {
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(allow_dirty=True),
        "command": "benchmarks/peers_checkpointing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rows": {}}
    try:
        import inspect

        import transformers

        record["transformers"] = transformers.__version__
        source = inspect.getsource(transformers.PreTrainedModel)
        found = re.search(r"_checkpointing_kwargs = (\{[^}]*\})", source)
        record["hf_kwargs"], record["hf_default_kwargs"] = HF_KWARGS, found.group(1) if found else "unknown"
    except (ImportError, OSError):
        pass
    if args.architectures:
        from tests.hf_architectures import ARCHITECTURES, available

        record["mode"] = "architectures"
        names = [m for m in (args.models or ARCHITECTURES) if available(m)]
    else:
        names = args.models or list(MODELS)
    path = RESULTS / f"{args.tag}.json"
    if args.update and path.is_file():
        earlier = json.loads(path.read_text())
        note = (f"{', '.join(names)} measured {record['date']} at commit {record['commit']} by "
                f"`{record['command']}`")
        record = dict(earlier, note="; ".join(filter(None, [earlier.get("note"), note])))
    for name in names:
        worker_name = f"arch:{name}" if args.architectures else name
        repeats = 0 if args.architectures else args.repeats
        rows = record["rows"].get(name, {})
        if args.update and args.head_to_head and "peak_bytes" in rows.get("remat", {}):
            # The peaks are kept: only the times of the three in one process are added.
            rows["head_to_head"] = spawn(worker_name, "both", rows["peer"]["peak_bytes"], args.head_to_head,
                                         args.threads)
            print(name, json.dumps(rows["head_to_head"]), flush=True)
            path.write_text(json.dumps(record, indent=1))
            continue
        peer = spawn(worker_name, "peer", None, repeats, args.threads)
        rows = record["rows"][name] = {"peer": peer}
        if "peak_bytes" in peer:
            rows["remat"] = spawn(worker_name, "remat", peer["peak_bytes"], repeats, args.threads)
        elif peer.get("unsupported"):
            rows["remat"] = spawn(worker_name, "remat", None, 0, args.threads)
        if not args.architectures and not args.no_fifty and "peak_bytes" in peer:
            rows["remat_50"] = spawn(worker_name, "remat", "50%", 0, args.threads)
        if args.head_to_head and "peak_bytes" in rows.get("remat", {}):
            rows["head_to_head"] = spawn(worker_name, "both", peer["peak_bytes"], args.head_to_head,
                                         args.threads)
        print(name, json.dumps(rows), flush=True)
        # Written after each model: a run cut short keeps what it measured.
        if not args.update:
            record["seconds"] = time.time() - started
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
    print("\n".join(render_section()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        name, method, budget, repeats, threads = sys.argv[2:7]
        if int(threads):
            import torch

            torch.set_num_threads(int(threads))
        parsed: int | str | None = budget if budget.endswith("%") else (int(budget) or None)
        print(json.dumps(measure(name, method, parsed, int(repeats))))
        raise SystemExit(0)
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
