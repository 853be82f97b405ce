"""Lightning callbacks: the batch-size search and the TensorBoard memory timeline.

They live in :mod:`lightning_remat.lightning`; this package keeps the import path users know.
"""

from lightning_remat.lightning.batch_size import RematBatchSizeFinder
from lightning_remat.lightning.memory_timeline import MemoryTimelineLogger

__all__ = ["MemoryTimelineLogger", "RematBatchSizeFinder"]
