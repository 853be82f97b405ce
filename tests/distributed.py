"""Two CPU ranks (gloo) for several Trainer fits in one spawn.

Spawning ranks costs most of a distributed test's time (each process imports torch and
Lightning), so :func:`run_ranks` starts two processes once and runs a list of scenarios in
them, one after the other, as a launcher such as ``torchrun`` would: the environment says
torchelastic started them, so every ``Trainer`` in a scenario uses the process group the
first one created instead of launching processes of its own. A scenario is a function
``(rank, out_dir) -> None`` that writes what the test compares under ``out_dir``; a rank
that raises, or ranks that hang past the deadline, fail the test with what they printed.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, scenarios: list[Callable[[int, Path], None]], out: str, repo: str) -> None:
    sys.path.insert(0, repo)
    os.environ.update(TORCHELASTIC_RUN_ID="lightning-remat-tests", RANK=str(rank), LOCAL_RANK=str(rank),
                      GROUP_RANK="0", WORLD_SIZE=str(WORLD_SIZE), LOCAL_WORLD_SIZE=str(WORLD_SIZE),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    try:
        for scenario in scenarios:
            scenario(rank, Path(out) / scenario.__name__)
            if dist.is_initialized():
                dist.barrier()
    except BaseException:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(out: Path, scenarios: list[Callable[[int, Path], None]], timeout: float = 600.0) -> None:
    """Run ``scenarios`` in order on two spawned ranks; each writes under
    ``out / scenario.__name__``. Fails on an error in a rank or when the ranks hang."""
    out.mkdir(parents=True, exist_ok=True)
    for scenario in scenarios:
        (out / scenario.__name__).mkdir(exist_ok=True)
    repo = str(Path(__file__).resolve().parents[1])
    context = mp.start_processes(_worker, args=(_free_port(), scenarios, str(out), repo), nprocs=WORLD_SIZE,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"the ranks hung past {timeout:.0f} s; done: "
                                     f"{sorted(p.name for p in out.glob('*/done*'))}")
    except ProcessException as exc:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error*.txt")))
        raise AssertionError(f"a rank failed:\n{errors or exc}") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
