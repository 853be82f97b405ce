"""``lightning.pytorch``'s :mod:`lightning_remat.lightning.batch_size` (see :mod:`lightning_remat.unified`)."""

from lightning_remat.unified import exec_twin

exec_twin(globals())
