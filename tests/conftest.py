"""What every test process shares.

Under pytest-xdist (``make test`` runs ``-n 2``) each worker is a process with torch's
default intra-op threads, one per core: two workers on a 2-core machine run four busy
threads, and OpenMP's spinning between parallel regions then costs more than the threads
gain (the zoo's vision tests took 78 s that way and 55 s with a thread per worker). Each
worker gets its share of the cores, and so do the child processes it starts (the
allocator's-edge meters, the distributed spawns), through ``OMP_NUM_THREADS``. A run
without workers keeps torch's default.

``make test`` sends each test file to one worker (``--dist loadfile``), so the fixtures a
file shares (a spawn of ranks, an allocator's-edge child, a zoo model's plan) are made once.
pytest-xdist's ``loadgroup`` would group finer, but under pytest 9 it groups nothing: it
renames node ids through a field pytest 9 no longer reads.

The files go to the workers longest first (``tests/file_seconds.json``, from a run's report:
``make durations``; a file it does not list counts as long), with xdist's own reordering by
the number of tests off (``--no-loadscope-reorder``): by that number the allocator's-edge
files, a few tests each and a minute or more, came last, and one worker ran them while the
other sat idle (on a run's figures, 919 and 836 s of work against 877 and 877).
"""

from __future__ import annotations

import os


def _worker_threads() -> int | None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not workers:
        return None
    return max(1, (os.cpu_count() or 1) // int(workers))


_THREADS = _worker_threads()
if _THREADS is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items: list) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.file_seconds import load

    seconds = load()
    unknown = max(seconds.values(), default=0)
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], unknown))
