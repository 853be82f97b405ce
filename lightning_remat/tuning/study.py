"""The Optuna study a batch-size search records in: its storage (SQLite beside the plan
cache, moved aside when unreadable), its name (what the answer depends on), trials left
running by a killed search, and what the study holds."""

from __future__ import annotations

import contextlib
import hashlib
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, TrialState
from torch import nn

from lightning_remat.cache import default_cache_dir, is_access_problem, move_aside, sqlite_problem
from lightning_remat.device import device_name
from lightning_remat.errors import warn_caller

PARAM = "batch_size"
"""The one parameter of a batch-size study."""


def sqlite_path(storage: Any) -> Path | None:
    """The file of an Optuna SQLite storage URL (``sqlite:///path``), else None."""
    if isinstance(storage, str) and storage.startswith("sqlite:///"):
        path = storage.removeprefix("sqlite:///").split("?", 1)[0]
        return None if path in ("", ":memory:") else Path(path)
    return None


HEARTBEAT_SECONDS = 1
"""How often a running trial of a storage opened from a URL records that it is alive; one
not heard from for twice that long (Optuna's default grace period) is stale."""


class StaleTrials:
    """Trials a killed search left running: Optuna fails them once their heartbeat is stale
    (``fail_stale_trials``) and this callback retries each
    (``RetryHeartbeatStaleTrialCallback``), keeping its size for one warning."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.sizes: list[Any] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            self._retry = optuna.storages.RetryHeartbeatStaleTrialCallback()

    def __call__(self, study: Study, trial: FrozenTrial) -> None:
        self.sizes.append(trial.params.get(PARAM))
        self._retry(study, trial)

    def fail(self, study: Study) -> None:
        """Fail and retry the stale trials, with one warning. A trial whose heartbeat is
        still fresh may be a search killed a moment ago: it is waited for until the grace
        period tells (a search running the same study elsewhere keeps its trials alive,
        and they are left to it)."""
        # Optuna's grace period, plus the beat before the kill and SQLite's whole seconds.
        wait_until = time.monotonic() + 3 * HEARTBEAT_SECONDS + 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
            while (study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   and time.monotonic() < wait_until):
                time.sleep(0.25)
                optuna.storages.fail_stale_trials(study)
        self.warn(study)

    def warn(self, study: Study) -> None:
        """One warning for the trials failed and retried since the last one."""
        if self.sizes:
            warn_caller(
                f"lightning-remat batch-size search ({self.label}): {len(self.sizes)} trial(s) of study "
                f"{study.study_name!r} were left running by an interrupted search (batch sizes "
                f"{self.sizes}); marked them failed, their sizes run again")
            self.sizes.clear()


def load_study(storage: str | optuna.storages.BaseStorage | None, study_name: str,
                sampler: BaseSampler, stale: StaleTrials) -> Study:
    """Create or load the study; an SQLite file that cannot be read is moved aside with one
    warning and the search starts over in a new one. One that cannot be opened or written (a
    read-only file or folder, a folder path under a file) warns once and the search runs in
    memory, its trials not stored."""
    def load(storage: str | optuna.storages.BaseStorage | None = storage) -> Study:
        storage_object = storage
        if isinstance(storage, str):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage_object = optuna.storages.RDBStorage(
                    storage, heartbeat_interval=HEARTBEAT_SECONDS, heartbeat_stale_trial_callback=stale)
        return optuna.create_study(storage=storage_object, study_name=study_name, sampler=sampler,
                                   directions=["maximize", "maximize"], load_if_exists=True)

    path = sqlite_path(storage)
    if path is None:
        return load()
    problem = sqlite_problem(path)
    if problem is None:
        try:
            return load()
        except Exception as exc:  # SQLAlchemy's and Optuna's errors for a foreign schema
            import sqlalchemy.exc

            if not isinstance(exc, (sqlalchemy.exc.SQLAlchemyError, RuntimeError)):
                raise
            problem = str(exc).splitlines()[0]
            if not path.exists() and not is_access_problem(problem):
                raise
    if not is_access_problem(problem):
        try:
            move_aside(path, problem, "batch-size study storage")
            return load()
        except OSError as exc:
            problem = f"{problem}; then {exc}"
    warn_caller(f"lightning-remat: batch-size study storage {path} cannot be used ({problem}); the "
                "search goes on without it: its trials are kept in memory and not stored")
    return load(None)


@contextlib.contextmanager
def optuna_logs_quiet() -> Iterator[None]:
    """Optuna's log level at WARNING inside, as it was outside."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def trial_progress(enabled: bool, label: str) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(desc=f"batch size ({label})", unit="trial", leave=False, dynamic_ncols=True)


def default_storage(root_dir: str | Path) -> str:
    """``sqlite:///<root_dir>/lightning_remat_cache/batch_size.db`` (the folder is created)."""
    folder = default_cache_dir(Path(root_dir).resolve())
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # the search warns that it cannot use the file, and runs in memory
    return f"sqlite:///{folder / 'batch_size.db'}"


def study_name_for(model: nn.Module, device: torch.device, budget_bytes: int | None, solver: str,
                   sample_shape: str = "", precision: str = "", ranks: int = 1, offload: bool = True) -> str:
    """``<ModelClass>#<fingerprint>|<device>|<budget bytes>|<solver>[|no offload][|<precision>][|<ranks>
    ranks][|<per-sample input shapes>]|lightning-remat <version>``: one study per setting,
    so a resumed search only reuses trials that measured the same thing (a changed model,
    its attention implementation say, starts a study of its own; :func:`module_fingerprint`;
    another release of this package plans and measures otherwise).
    ``budget_bytes`` None: the budget is the device's free memory, read afresh by each run
    (and each trial), so the name says ``free`` rather than one run's reading, which a
    resumed search would not read again to the byte."""
    budget = "free" if budget_bytes is None else f"{budget_bytes}B"
    parts = [f"{type(model).__name__}#{module_fingerprint(model)}", device_name(torch.device(device)),
             budget, solver]
    if not offload:
        parts.append("no offload")
    if precision:
        parts.append(str(precision))
    if ranks > 1:
        parts.append(f"{ranks} ranks")
    if sample_shape:
        parts.append(sample_shape)
    parts.append(f"lightning-remat {_release()}")
    return "|".join(parts)


def _release() -> str:
    """This package's installed version (its metadata: the package itself sits further
    up the data flow)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning_remat")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "source"


def module_fingerprint(model: nn.Module) -> str:
    """A short hash of what a batch-size search's answer depends on in ``model``: its
    modules' classes, its parameters' and buffers' names, shapes, dtypes and whether they
    train, and the settings of each ``config`` it holds (a Hugging Face config's JSON and
    attention implementation)."""
    digest = hashlib.sha1()
    configs: set[int] = set()
    for name, sub in model.named_modules():
        digest.update(f"{name}:{type(sub).__module__}.{type(sub).__qualname__};".encode())
        config = getattr(sub, "config", None)
        if config is not None and id(config) not in configs:
            configs.add(id(config))
            to_json = getattr(config, "to_json_string", None)
            try:
                text = to_json(use_diff=False) if callable(to_json) else repr(vars(config))
            except Exception:  # a config we cannot read: its type alone
                text = type(config).__qualname__
            digest.update(f"{text};{getattr(config, '_attn_implementation', None)};".encode())
    for name, p in model.named_parameters():
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    for name, b in model.named_buffers():
        digest.update(f"{name}:{tuple(b.shape)}:{b.dtype};".encode())
    return digest.hexdigest()[:12]
