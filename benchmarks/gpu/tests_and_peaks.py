"""GPU command 1: the GPU tests, the predicted against the measured CUDA peak for several
models and budgets with and without ``expandable_segments``, and the offload executor's
overlap of copies with compute.

    python benchmarks/gpu/tests_and_peaks.py            # under 9 minutes on one H100
    python benchmarks/gpu/tests_and_peaks.py --dry-run  # the parts, without a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu.common import Report, dry_run, parser, refuse_without_cuda, run_part  # noqa: E402

GPU_TESTS = ["tests/test_profile.py", "tests/test_offload_executor.py", "tests/test_device_layer.py",
             "tests/test_device.py", "tests/test_memory_meter.py"]
PREDICTION_MODELS = ["gpt", "resnet18"]
ALLOCATOR = {"default": "", "expandable": "expandable_segments:True"}


def parts() -> list[tuple[str, list[str], float, dict[str, str]]]:
    """(name, command, seconds, environment) of each part, in order."""
    out = [("GPU tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *GPU_TESTS], 170.0, {})]
    for label, conf in ALLOCATOR.items():
        out.append((f"predicted vs measured CUDA peaks ({label} allocator)",
                    ["benchmarks/prediction.py", "--measure", "--device", "cuda", "--python", sys.executable,
                     "--models", *PREDICTION_MODELS], 140.0, {"PYTORCH_CUDA_ALLOC_CONF": conf}))
    out.append(("offload overlap", ["benchmarks/overlap.py"], 60.0, {}))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    report = Report("tests_and_peaks")
    if args.dry_run:
        return dry_run(report, [f"{name} (at most {s:.0f} s): {' '.join(cmd)}" for name, cmd, s, _ in parts()])
    if refuse_without_cuda(report):
        for name, command, seconds, env in parts():
            run_part(report, name, command, seconds, env)
    report.write(args.out)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
