"""Measure every vertex's costs on the module's own device (docs/design.md sections 3 and 6).

``profile_module`` runs real training steps (forward, loss, backward) node by node through a
``torch.fx.Interpreter`` and fills, for each vertex of the traced graph:

- ``mem``: bytes of the output (per storage, at most the storage's size);
- ``saved``: bytes autograd keeps for the op's backward, seen by
  ``torch.autograd.graph.saved_tensors_hooks`` while the op runs, each storage counted once
  (by ``untyped_storage().data_ptr()``), parameters and buffers excluded. ReLU keeps its
  output, Linear its input, BatchNorm its input plus the batch mean and inverse std;
- ``t_fwd``/``t_bwd``: median over ``repeats`` steps after ``warmup`` steps; the forward is
  timed around the op, the backward by pre/post hooks on every autograd node the op created
  (``perf_counter`` on CPU, CUDA events on GPU);
- ``ws_fwd``/``ws_bwd``: the peak during the op above the larger of the bytes in use before
  and after it (the op's temporary workspace; the largest over the measured steps): on CUDA
  the allocator's peak counter, on CPU the allocation log of docs/design.md section 6 (every
  allocation, a oneDNN convolution's scratch and im2col's column buffers included), in one
  extra step.

Memory-safe mode (``safe=True``, or automatically when the plain step runs out of memory)
never holds all activations: the forward runs under ``no_grad`` (values freed after their
last use, as in inference) and each op is measured on its own from detached copies of its
inputs, forward and backward, then dropped. It gives the same ``mem`` and ``saved``.

Profiling does not change training: buffers (BatchNorm running statistics), training flags,
the RNG state and existing ``.grad`` tensors are restored afterwards; parameters are only read
(no optimizer step runs).

This module runs the steps and builds the graph from what they measured; the op-by-op
measurement is :mod:`lightning_remat.graph.opmeter`'s (the normal and the memory-safe mode
share it), the clocks, workspace readings and backward hooks it reads are
:mod:`lightning_remat.graph.instruments`'.
"""

from __future__ import annotations

import mmap
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remat.device import (
    free_device_memory,
    is_out_of_memory,
    module_device,
)
from lightning_remat.errors import warn_caller
from lightning_remat.graph.effects import preserved_state
from lightning_remat.graph.instruments import Clock, OpRecord, output_bytes, storage_of
from lightning_remat.graph.ir import Graph
from lightning_remat.graph.opmeter import NodeProfiler, OpMeter, SubmoduleProfiler
from lightning_remat.graph.sharding import call_through
from lightning_remat.graph.trace import (
    CHILDREN,
    Traced,
    as_tuple,
    loop_loss,
    trace_module,
)
from lightning_remat.graph.vertices import ValueRecorder
from lightning_remat.measure.allocations import mapped_buffer_bytes
from lightning_remat.measure.peak import StepMeter, peak_bytes, step_meter
from lightning_remat.measure.timeline import tensors_in

__all__ = ["profile_module"]

LossFn = Callable[[Any], torch.Tensor]


# ---- the public entry point ------------------------------------------------------------------------


def _dtype_of(module: nn.Module, inputs: Iterable[Any]) -> str:
    candidates = list(module.parameters()) + tensors_in(list(inputs))
    for t in candidates:
        if t.is_floating_point():
            return str(t.dtype).replace("torch.", "")
    return "float32"


@contextmanager
def _grads_set_aside(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Move existing .grad tensors away (steps start from none) and put them back after."""
    kept = [(t, t.grad) for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        yield
    finally:
        for t, grad in kept:
            t.grad = grad


def _clear_grads(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.grad = None


def _other_batch(inputs: tuple[Any, ...], kwargs: dict[str, Any], batch: int) -> tuple[tuple[Any, ...], dict[str, Any], int]:
    """The inputs at another batch size (half, or 2 when the batch is 1)."""
    other = batch // 2 if batch >= 2 else 2

    def resize(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == batch:
            return t[:other] if other < batch else torch.cat([t] * other)[:other]
        return t

    return pytree.tree_map(resize, inputs), pytree.tree_map(resize, kwargs), other


def _batch_dependence(traced: Traced, module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any],
                      batch: int | None, numel: dict[str, int], device: torch.device) -> dict[str, bool]:
    """Whether each vertex's output size changes with the batch size: one no-grad forward at
    another batch size. Structural fallback (does the vertex depend on an input?) when that
    forward fails or there is no batch dimension."""
    graph = traced.graph
    reach = set(graph.meta.input_consumers or [])
    for vid in graph.ids:
        if any(p in reach for p in graph.predecessors(vid)):
            reach.add(vid)
    structural = {vid: vid in reach for vid in graph.ids}
    if not batch:
        return structural
    small_inputs, small_kwargs, _ = _other_batch(inputs, kwargs, batch)
    try:
        with preserved_state(module, [device]), torch.no_grad():
            small_numel = _numel_per_node(traced, module, small_inputs, small_kwargs)
    except Exception:  # a model that fixes its batch size: keep the structural answer
        return structural
    vertex_of = {name: vid for name, vid in traced.charge.items() if vid in graph and name == vid}
    result = dict(structural)
    for name, vid in vertex_of.items():
        if name in small_numel and vid in numel:
            result[vid] = structural[vid] and small_numel[name] != numel[vid]
    return result


def _numel_per_node(traced: Traced, module: nn.Module, inputs: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> dict[str, int]:
    """Elements of each fx node's value, or of each vertex submodule's output (fallback:
    forward hooks while the model's own forward runs)."""
    if traced.kind != CHILDREN:
        recorder = ValueRecorder(traced.runner)
        call_through(module, lambda: recorder.run(*traced.call_args(inputs, kwargs)))
        return recorder.numel
    found: dict[str, int] = {}
    handles = [
        child.register_forward_hook(
            lambda mod, args, out, name=name: found.setdefault(name, sum(t.numel() for t in tensors_in(out))))
        for name, child in traced.children
    ]
    try:
        module(*inputs, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return found


def profile_module(
    module: nn.Module,
    example_inputs: Any,
    *,
    loss_fn: LossFn | None = None,
    warmup: int | None = None,
    repeats: int = 3,
    safe: bool = False,
    traced: Traced | None = None,
    example_kwargs: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
    agree: Callable[[bool], bool] | None = None,
) -> Graph:
    """Trace (unless ``traced`` is given) and profile ``module`` on its device.

    ``example_inputs``: a tensor or a tuple of positional inputs, on the module's device.
    ``loss_fn(outputs) -> scalar``: the step's loss, taken as ``loss_fn(module(x)).backward()``
    (the outputs dropped once the loss has read them); without it the loop people write,
    ``out = module(x); loss = loop_loss(out); loss.backward()`` (the outputs held to the
    step's end, ``meta.outputs_held``, and a cross-entropy over them).
    Returns the :class:`Graph` with measured costs. Its meta
    (:class:`~lightning_remat.graph.ir.GraphMeta`, whose fields :mod:`lightning_remat.graph.ir`
    documents) keeps the tracer's fields and sets ``batch_size``, ``device``, ``dtype``,
    ``input_bytes``, ``plain_peak_bytes`` and ``loss_peak_bytes`` (measured with
    :func:`~lightning_remat.measure.peak.peak_bytes`; None in safe mode), ``step_seconds``,
    ``batch_dependent``, ``saved_refs``, ``saved_input_bytes``, ``aliases``,
    ``requires_grad``, ``resident_views`` and ``safe``.

    Normal mode runs ``warmup`` plain steps (default: 1 on CUDA; 0 on the CPU, where the
    metered step is the first and its storage counts do not depend on warm caches), one
    plain step inside the meter (the plain peak), on the CPU one instrumented step inside
    the meter (bytes and workspaces), then timed instrumented steps: the first, and more
    (up to ``repeats``) only while op times vary enough to change a plan
    (docs/design.md section 3). An op's time is its fastest timed measurement. Safe mode
    measures each op ``warmup`` (default 1) + ``repeats`` times and takes the median.
    ``progress(line)``: called with a short line as each phase starts.
    ``agree(flag) -> bool``: whether ``flag`` holds on any rank, for ranks that profile
    together (torch FSDP's collectives, a collective in the forward): every decision that
    changes which steps run (one more timed step, the memory-safe fallback) is then the
    ranks' together, never one rank's from its own timings or its own error.
    """
    agree = agree or (lambda flag: flag)
    if warmup is None:
        warmup = 1 if safe or module_device(module).type == "cuda" else 0
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    inputs = as_tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    # Without the step's own loss, the loop people write: the outputs held to the step's
    # end and a cross-entropy over them (docs/design.md section 4.7).
    outputs_held = loss_fn is None
    loss_fn = loss_fn or loop_loss
    device = module_device(module, list(inputs) + list(kwargs.values()))
    if traced is None:
        traced = trace_module(module, inputs, kwargs)
    input_tensors = tensors_in(list(inputs) + list(kwargs.values()))
    batch = next((t.shape[0] for t in input_tensors if t.dim() >= 1), None)
    grad_holders = list(module.parameters()) + [t for t in input_tensors if t.requires_grad]
    excluded = {storage_of(t)[0] for t in list(module.parameters()) + list(module.buffers())}
    if traced.kind == CHILDREN:

        def make(safe_mode: bool = False, rounds: int = 1,
                 meter: StepMeter | None = None) -> tuple[OpMeter, Callable[[], Any]]:
            profiler = SubmoduleProfiler(traced, module, device, excluded, safe_mode, rounds, meter)
            return profiler, lambda: profiler.run(inputs, kwargs)
    else:
        args = traced.call_args(inputs, kwargs)

        def make(safe_mode: bool = False, rounds: int = 1,
                 meter: StepMeter | None = None) -> tuple[OpMeter, Callable[[], Any]]:
            profiler = NodeProfiler(traced, device, excluded, safe_mode, rounds, meter)
            # Through the module's call when it is an FSDP unit: its hooks gather and reduce.
            return profiler, lambda: call_through(module, lambda: profiler.run(*args))

    meta = traced.graph.meta.copy()
    meta.batch_size = batch
    meta.device = str(device)
    meta.dtype = _dtype_of(module, inputs)
    meta.input_bytes = output_bytes(input_tensors)
    meta.outputs_held = outputs_held
    # CUDA events and peak counters work on the current device: make it the module's.
    on_device = torch.cuda.device(device) if device.type == "cuda" else nullcontext()
    with on_device, preserved_state(module, [device]), _grads_set_aside(grad_holders):
        fallback_reason = ""
        records: list[OpRecord] = []
        note = progress or (lambda line: None)
        if not safe:
            try:
                note("profile: the plain step's peak")
                meta.plain_peak_bytes, plain_seconds = _plain_peak(
                    module, inputs, kwargs, loss_fn, device, grad_holders, warmup, outputs_held)
                meta.loss_peak_bytes, meta.output_grad_bytes = _loss_peak(
                    module, inputs, kwargs, loss_fn, device)
                first, records, wall = _profile_steps(make, loss_fn, grad_holders, repeats, device,
                                                      plain_seconds, note, agree)
                meta.step_seconds = plain_seconds or wall
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                fallback_reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            # Taken by every rank or by none: a rank profiling in safe mode alone would run
            # other collectives than the rest.
            if agree(bool(fallback_reason)) and not fallback_reason:
                fallback_reason = "another rank ran out of memory"
        if fallback_reason:
            # The exception (and its frames holding activations) is gone here; free the cache.
            _clear_grads(grad_holders)
            free_device_memory(device)
            warn_caller(f"the training step ran out of memory while profiling "
                        f"({fallback_reason}); profiling again in memory-safe mode")
            safe = True
        if safe:
            meta.plain_peak_bytes = None
            meta.loss_peak_bytes = None
            meta.output_grad_bytes = None
            meta.step_seconds = None
            note("profile: each op alone (memory-safe mode)")
            records = _profile_safe(make, grad_holders, warmup, repeats, device)
            first = records[0]
        _clear_grads(grad_holders)
        note("profile: which sizes grow with the batch")
        meta.batch_dependent = _batch_dependence(traced, module, inputs, kwargs, batch,
                                                 first.numel, device)

    # Timed steps in normal mode: the fastest (a disturbance only adds time); safe mode's
    # rounds: the median.
    combine = statistics.median if safe else min
    nodes = []
    for node in traced.graph.nodes:
        vid = node.id
        nodes.append(replace(
            node,
            mem=first.mem.get(vid, 0),
            saved=sum(first.saved_ptrs.get(vid, {}).values()),
            t_fwd=combine(r.t_fwd.get(vid, 0.0) for r in records),
            t_bwd=combine(r.t_bwd.get(vid, 0.0) for r in records),
            ws_fwd=max(r.ws_fwd.get(vid, 0) for r in [first, *records]),
            ws_bwd=max(r.ws_bwd.get(vid, 0) for r in [first, *records]),
        ))
    meta.saved_refs = {vid: list(first.saved_refs.get(vid, [])) for vid in traced.graph.ids}
    meta.saved_input_bytes = {vid: b for vid, b in first.saved_input.items() if b}
    meta.aliases = dict(first.aliases)
    meta.requires_grad = {vid: first.requires_grad.get(vid, False) for vid in traced.graph.ids}
    meta.resident_views = [vid for vid in traced.graph.ids if vid in first.resident_views]
    if device.type != "cuda":
        meta.scratch_buffers = first.scratch_buffers
        meta.mapped_buffer_bytes, meta.page_bytes = mapped_buffer_bytes(), mmap.PAGESIZE
    meta.safe = safe
    if safe:
        meta.step_seconds = sum(n.t_fwd + n.t_bwd for n in nodes)
    return Graph(nodes, list(traced.graph.edges), meta)


def _backward(loss: torch.Tensor) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError(f"loss_fn must return a scalar tensor, got {loss!r:.80}")
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not require grad: the module has no trainable parameters on the "
            "path to its output and no input requires grad, so there is no backward to profile"
        )
    loss.backward()


def _plain_peak(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn,
                device: torch.device, grad_holders: list[torch.Tensor],
                warmup: int, outputs_held: bool = False) -> tuple[int, float | None]:
    """Plain forward+backward steps: ``warmup`` unmeasured, then one inside the meter
    (``meta.plain_peak_bytes``); ``outputs_held``: the step holds the outputs until the
    backward has ended. On CUDA the allocator's counters cost the step nothing, so
    its time is the plain step's (``meta.step_seconds``); on the CPU the storage meter's
    per-op cost is in it, so no time is returned."""
    clock = Clock(device)

    def step() -> None:
        outputs = module(*inputs, **kwargs)
        loss = loss_fn(outputs)
        if not outputs_held:
            del outputs
        _backward(loss)

    for _ in range(warmup):
        step()
        _clear_grads(grad_holders)
    start = time.perf_counter()
    peak = peak_bytes(step, device)  # collects garbage first (CPU)
    clock.sync()
    seconds = time.perf_counter() - start if device.type == "cuda" else None
    _clear_grads(grad_holders)
    return int(peak), seconds


def _loss_peak(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn,
               device: torch.device) -> tuple[int, int]:
    """The loss alone (``meta.loss_peak_bytes``): on the outputs of a forward without
    autograd, made leaves, the peak of ``loss_fn`` and the gradients it sends to the
    outputs, inside the meter. A sum sends a broadcast scalar (nothing); a cross-entropy
    over a vocabulary holds its log-probabilities and their gradient beside the logits'.
    With it, the bytes of those gradients (``meta.output_grad_bytes``): each storage once."""
    with torch.no_grad():
        outputs = module(*inputs, **kwargs)

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            return value.detach().requires_grad_()
        return value

    leaves = pytree.tree_map(leaf, outputs)
    del outputs
    wanting = [t for t in pytree.tree_leaves(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]

    sent: list[torch.Tensor] = []
    peak = int(peak_bytes(partial(_loss_and_gradients, loss_fn, leaves, wanting, sent), device))
    storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in sent}
    del sent
    held = [weakref.ref(t) for t in wanting]
    del leaves, wanting
    if any(ref() is not None for ref in held):
        warn_caller(
            "the loss keeps the module's outputs alive after it returns (a reference cycle, or a "
            "reference kept elsewhere), so they outlive the start of the backward, where the plan "
            "counts them freed: the measured peak can exceed the plan's. Take the loss without "
            "keeping the outputs (a recursive closure over a list of them is such a cycle)")
    return peak, int(sum(storages.values()))


def _loss_and_gradients(loss_fn: LossFn, leaves: Any, wanting: list[torch.Tensor],
                        sent: list[torch.Tensor]) -> None:
    loss = loss_fn(leaves)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        grads = torch.autograd.grad(loss, wanting, allow_unused=True)
        sent.extend(g for g in grads if g is not None)


_UNSETTLED_SHARE = 0.05
"""Timed steps repeat while the time in doubt is above this share of the step."""
_VARIES = 0.25
"""An op whose two timings differ by more than this fraction varies across steps."""


def _op_times(record: OpRecord) -> dict[str, float]:
    return {vid: record.t_fwd.get(vid, 0.0) + record.t_bwd.get(vid, 0.0)
            for vid in set(record.t_fwd) | set(record.t_bwd)}


def _time_in_doubt(timed: list[OpRecord], upper: OpRecord | None, step_seconds: float | None) -> float:
    """Seconds of the step whose measurement another timed step could change, as a share
    of the step. With two timed steps or more: the time of the ops whose latest timing
    differs from their fastest by more than :data:`_VARIES`. With one: on the CPU, the time
    by which an op ran slower than in the metered step (which carries the meter's per-op
    cost on top, so an undisturbed op is never slower without it); on CUDA, the time by
    which the ops' sum exceeds the plain step they are part of."""
    latest = _op_times(timed[-1])
    total = sum(latest.values()) or 1e-12
    if len(timed) >= 2:
        fastest = {vid: min(_op_times(r).get(vid, 0.0) for r in timed[:-1]) for vid in latest}
        doubt = sum(t for vid, t in latest.items()
                    if abs(t - fastest[vid]) > _VARIES * max(fastest[vid], 1e-9))
        return doubt / total
    if upper is not None:
        bound = _op_times(upper)
        return sum(max(0.0, t - bound.get(vid, t)) for vid, t in latest.items()) / total
    if step_seconds:
        return max(0.0, total - step_seconds) / total
    return 0.0


def _profile_steps(make: Callable[..., tuple[OpMeter, Callable[[], Any]]], loss_fn: LossFn,
                   grad_holders: list[torch.Tensor], repeats: int, device: torch.device,
                   plain_seconds: float | None, note: Callable[[str], None],
                   agree: Callable[[bool], bool]) -> tuple[OpRecord, list[OpRecord], float]:
    """Normal mode: instrumented steps, each op measured as the forward reaches it
    (docs/design.md section 3). Returns the record whose bytes count (CPU: a step under
    the storage meter, whose workspaces it reads; CUDA: the first timed step, whose
    workspaces come from the allocator's counters), the timed records, and the fastest
    timed step's wall time. A timed step repeats, up to ``repeats``, only while the time in
    doubt (:func:`_time_in_doubt`) is above :data:`_UNSETTLED_SHARE` of the step on some
    rank (``agree``): one timed step where one will do, as many on every rank."""

    def step(meter: StepMeter | None = None) -> tuple[OpRecord, float]:
        profiler, run = make(meter=meter)
        start = time.perf_counter()
        loss = loss_fn(run())
        _backward(loss)
        profiler.record.resolve(profiler.clock)
        seconds = time.perf_counter() - start
        profiler.timer.clear()
        del loss
        _clear_grads(grad_holders)
        return profiler, seconds

    metered: OpRecord | None = None
    if device.type != "cuda":
        note("profile: the step's bytes, op by op")
        with step_meter(device.type) as meter:
            profiler, _ = step(meter)
        profiler.workspace.settle()
        metered = profiler.record
        metered.scratch_buffers = profiler.workspace.scratch_buffers
    timed: list[OpRecord] = []
    walls: list[float] = []
    while len(timed) < repeats:
        note("profile: the step's times, op by op" if not timed else
             f"profile: op times varied, timing again ({len(timed) + 1} of at most {repeats})")
        profiler, wall = step()
        timed.append(profiler.record)
        walls.append(wall)
        if not agree(_time_in_doubt(timed, metered, plain_seconds) > _UNSETTLED_SHARE):
            break
    return metered if metered is not None else timed[0], timed, min(walls)


def _profile_safe(make: Callable[..., tuple[OpMeter, Callable[[], Any]]],
                  grad_holders: list[torch.Tensor], warmup: int, repeats: int,
                  device: torch.device) -> list[OpRecord]:
    """Memory-safe mode: one no-grad forward; each op measured alone ``warmup + repeats``
    times (forward and backward), its activations dropped before the next op."""
    meter = step_meter(device.type) if device.type != "cuda" else None
    profiler, run = make(True, warmup + repeats, meter)
    with meter if meter is not None else nullcontext(), torch.no_grad():
        run()
    profiler.workspace.settle()
    _clear_grads(grad_holders)
    for record in profiler.records:
        record.scratch_buffers = profiler.workspace.scratch_buffers
    return profiler.records[warmup:]
