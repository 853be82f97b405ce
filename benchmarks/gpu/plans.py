"""GPU command 2: ``benchmarks/run.py``'s plans on CUDA (our solvers, measured against the
plain step) for ResNet-50 and the GPT, each within its own time limit.

    python benchmarks/gpu/plans.py            # under 9 minutes on one H100
    python benchmarks/gpu/plans.py --dry-run  # the parts, without a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import Report, dry_run, parser, refuse_without_cuda, run_part  # noqa: E402

MODELS = ["resnet50", "gpt"]


def parts() -> list[tuple[str, list[str], float]]:
    return [(f"run.py plans on CUDA: {model}",
             ["benchmarks/run.py", "--device", "cuda", "--tag", "cuda", "--models", model, "--part", "ours",
              "--no-compile", "--no-render", "--allow-dirty", "--timeout", "200"], 250.0)
            for model in MODELS]


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    report = Report("plans")
    if args.dry_run:
        return dry_run(report, [f"{name} (at most {s:.0f} s): {' '.join(cmd)}" for name, cmd, s in parts()])
    if refuse_without_cuda(report):
        for name, command, seconds in parts():
            run_part(report, name, command, seconds)
    report.write(args.out)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
