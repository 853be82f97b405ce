"""Lightning callbacks: the batch-size search and the TensorBoard memory timeline."""

from lightning_remat.callbacks.batch_size import RematBatchSizeFinder

__all__ = ["RematBatchSizeFinder"]
