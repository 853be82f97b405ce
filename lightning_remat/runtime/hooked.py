"""The executor of the tracing fallback: the model's own forward, its submodules checkpointed
where it calls them (docs/design.md section 5).

When ``torch.fx`` cannot trace a model (data-dependent control flow and the like), nothing
may stand in for its forward: a rebuilt one is only checked on the example input. Here the
model's own ``forward`` runs, with all its control flow, and each submodule that is a vertex
of the plan (:func:`lightning_remat.graph.trace.trace_module`, kind ``"children"``) has an
instance-level ``forward`` (:class:`CheckpointedForward`) that runs the submodule's own
forward under the action its stage has, as
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing``
does, but without a wrapper module: no ``_checkpoint_wrapped_module`` in the state_dict keys,
the same Parameter objects. Outside a planned forward (the original module called directly,
``eval()``, ``no_grad``) the submodules run as they are.

- ``recompute``: non-reentrant ``torch.utils.checkpoint`` with the RNG state replayed
  (``preserve_rng_state=True``); the recomputation reads the submodule's buffers and
  attributes as its forward did and leaves them as its forward did, so BatchNorm's running
  statistics and the module's own counters are updated once per step, and it fires no
  forward hook of the modules inside (:class:`~lightning_remat.graph.effects.OncePerStep`);
- ``offload``: under the module's saved-tensor hooks;
- ``keep``: plainly.

Each checkpointed submodule keeps its own input, so a plan here has one vertex per stage:
:func:`~lightning_remat.solvers.policy.per_submodule_plan` turns a solver's plan into that form and scores it with the
simulator, so the predicted peak describes what runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from lightning_remat.graph.effects import OncePerStep
from lightning_remat.solvers.plan import Plan, Stage

__all__ = ["CheckpointedForward", "SubmoduleCheckpointing"]

OffloadContext = Callable[[int, Stage], contextlib.AbstractContextManager]
Observer = Callable[[str, Any], None]
"""Called as ``observe(name, output)`` after a submodule of the plan has run (the measured
timeline); ``output`` is None where a recomputation stopped inside it."""


class CheckpointedForward:
    """The instance-level ``forward`` of a submodule: runs its own forward (the class's, or
    the instance-level one it replaced) under the action the running plan gives it.
    ``action`` is None outside a planned forward."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None) -> None:
        self.module = module
        self.inner = inner
        self.action: str | None = None
        self.stage_index = 0
        self.stage: Stage | None = None
        self.offload: OffloadContext | None = None
        self.name = ""
        self.observe: Observer | None = None

    def own_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _once_per_step(self) -> tuple[Any, Any]:
        """The recomputation reads the buffers and attributes the forward read, fires no
        forward hook, and leaves the state as the forward left it (BatchNorm's running
        statistics and the module's own counters are updated once per step)."""
        module = self.module
        kept = OncePerStep(lambda: list(module.buffers()), lambda: list(module.modules()), attributes=True)
        return kept.forward(), kept.recompute()

    def _observed(self, observe: Observer, *args: Any, **kwargs: Any) -> Any:
        """:meth:`own_forward`, then ``observe``; also where a recomputation stops inside
        it (torch's checkpoint stops one early by raising, once it has what it saves)."""
        try:
            output = self.own_forward(*args, **kwargs)
        except BaseException:
            observe(self.name, None)
            raise
        observe(self.name, output)
        return output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        action = self.action
        # The observer of this call: a recomputation runs after the planned forward ended.
        forward = self.own_forward if self.observe is None else functools.partial(self._observed, self.observe)
        if action == "recompute" and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(
                forward, *args, use_reentrant=False, preserve_rng_state=True,
                context_fn=self._once_per_step, **kwargs,
            )
        if action == "offload" and torch.is_grad_enabled() and self.offload is not None:
            assert self.stage is not None
            with self.offload(self.stage_index, self.stage):
                return forward(*args, **kwargs)
        return forward(*args, **kwargs)


def _install(module: nn.Module) -> CheckpointedForward:
    current = module.__dict__.get("forward")
    if isinstance(current, CheckpointedForward) and current.module is module:
        return current
    wrapper = CheckpointedForward(module, current)
    module.forward = wrapper  # type: ignore[method-assign]
    return wrapper


class SubmoduleCheckpointing:
    """Runs ``root``'s own forward under ``plan``, whose vertices are ``root``'s submodules
    (qualified names)."""

    def __init__(self, root: nn.Module, plan: Plan, observe: Observer | None = None) -> None:
        self.root = root
        self.plan = plan
        stage_of = plan.stage_of()
        self.actions = {name: (plan.stages[k].action, k) for name, k in stage_of.items()}
        self.observe = observe
        """Called after each submodule of the plan has run, in the forward and in a
        recomputation (:meth:`observed`)."""

    def observed(self, observe: Observer) -> SubmoduleCheckpointing:
        """The same plan on the same module, ``observe(name, output)`` called after each of
        its submodules has run (the measured timeline, docs/design.md section 6)."""
        return SubmoduleCheckpointing(self.root, self.plan, observe)

    @contextlib.contextmanager
    def _active(self, training: bool, offload: OffloadContext | None) -> Iterator[None]:
        wrappers = []
        for name, (action, k) in self.actions.items():
            wrapper = _install(self.root.get_submodule(name))
            wrapper.action = action if training else None
            wrapper.stage_index, wrapper.stage, wrapper.offload = k, self.plan.stages[k], offload
            wrapper.name, wrapper.observe = name, self.observe
            wrappers.append(wrapper)
        try:
            yield
        finally:
            for wrapper in wrappers:
                wrapper.action = None
                wrapper.observe = None

    def run(self, training: bool, args: tuple, kwargs: dict,
            offload: OffloadContext | None = None) -> Any:
        """``root``'s class forward (never an instance-level one: that may be whatever
        called this) with the plan's actions in force when ``training``."""
        with self._active(training, offload):
            return type(self.root).forward(self.root, *args, **kwargs)

    def sources(self) -> list[str]:
        return [f"{name}: {action}" for name, (action, _) in self.actions.items()]
