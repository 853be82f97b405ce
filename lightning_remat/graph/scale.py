"""The graph of another batch size, derived from profiles at one or two sizes (docs/design.md
section 3, "Scaling").

A training step's costs are, per vertex, an affine function of the batch size ``b``:

- bytes: an activation of shape ``(b, ...)`` takes ``b`` times the bytes of one sample; a
  vertex that does not grow with the batch (a parameter slice, a loss reduced over the
  batch) keeps its size; parameter bytes never change. ``mem``, ``saved``, the workspaces,
  the saved input bytes and the step's input bytes are affine in ``b``; its plain peak is
  the largest of the step's moments, each affine, so only between two profiled sizes does
  the line through them bound it (outside, the simulator gives it);
- times: a fixed cost per op (dispatch, kernel launch) plus a part that grows with ``b``.

From two profiles at sizes ``b1 < b2`` every such cost is the line through its two
measurements (bytes exact up to rounding). From one profile the batch-dependent vertices
(``meta.batch_dependent``) scale in proportion and the others stay, as
:meth:`~lightning_remat.graph.ir.Graph.scaled` does. Structure (vertices, edges, what each
op saves and aliases) is taken from the profile nearest in size.

The functions are pure: profiles in, a new :class:`~lightning_remat.graph.ir.Graph` out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from lightning_remat.graph.ir import Graph, Node

__all__ = ["derive_graph", "check_family"]

_BYTES = ("mem", "saved", "ws_fwd", "ws_bwd")
_TIMES = ("t_fwd", "t_bwd")


def check_family(profiles: Sequence[Graph]) -> list[Graph]:
    """The profiles sorted by batch size, after checking that they are one shape family:
    one or two graphs with a batch size each, distinct sizes, the same vertices, edges and
    op kinds. Raises ``ValueError`` saying what differs."""
    graphs = sorted(profiles, key=lambda g: g.meta.batch_size or 0)
    if not 1 <= len(graphs) <= 2:
        raise ValueError(f"derive a graph from one or two profiles, got {len(graphs)}")
    for g in graphs:
        if not g.meta.batch_size:
            raise ValueError("a profile without meta.batch_size cannot be scaled; profile a "
                             "batched input (its first dimension is the batch)")
    if len(graphs) == 2:
        small, large = graphs
        if small.meta.batch_size == large.meta.batch_size:
            raise ValueError(f"the two profiles have the same batch size ({small.meta.batch_size}); "
                             "profile two different sizes")
        if small.graph_hash() != large.graph_hash() or small.ids != large.ids:
            raise ValueError(
                f"the profiles at batch {small.meta.batch_size} and {large.meta.batch_size} have "
                "different graphs (the traced forward depends on the batch size): profile the "
                "size itself")
    return graphs


def _line(b: int, b1: int, v1: float, b2: int, v2: float, growing: bool) -> float:
    """The value at ``b`` on the line through ``(b1, v1)`` and ``(b2, v2)``, never below
    zero. ``growing``: a noisy measurement must not make a cost fall with the batch (times),
    so beyond the measured range a falling line is held at the nearer end's value."""
    slope = (v2 - v1) / (b2 - b1)
    if growing and slope < 0:
        return max(0.0, v1 if b <= b1 else v2 if b >= b2 else v1 + slope * (b - b1))
    return max(0.0, v1 + slope * (b - b1))


def derive_graph(profiles: Sequence[Graph], batch_size: int) -> Graph:
    """The graph at ``batch_size`` from profiles of the same model and input shape at one or
    two other batch sizes (module docstring). A profile at exactly ``batch_size`` is
    returned as a copy."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
    graphs = check_family(profiles)
    for g in graphs:
        if g.meta.batch_size == batch_size:
            return Graph.from_dict(g.to_dict())
    if len(graphs) == 1:
        derived = graphs[0].scaled(batch_size)
        base = graphs[0].meta
        ratio = batch_size / base.batch_size  # type: ignore[operator]
        dependent = base.batch_dependent or {}
        meta = derived.meta
        if base.saved_input_bytes is not None:  # inputs are batched
            meta.saved_input_bytes = {k: int(round(v * ratio)) for k, v in base.saved_input_bytes.items()}
        # The peak and step time are not per vertex: one profile cannot split them into a
        # fixed and a growing part, so they are left to the simulator (None).
        meta.plain_peak_bytes = None
        meta.step_seconds = None
        if base.loss_peak_bytes is not None:  # the loss works on the batch's outputs
            meta.loss_peak_bytes = int(round(base.loss_peak_bytes * ratio))
        if base.output_grad_bytes is not None:
            meta.output_grad_bytes = int(round(base.output_grad_bytes * ratio))
        if all(dependent.get(n.id, True) for n in graphs[0].nodes):
            meta.batch_dependent = base.batch_dependent
        return derived

    small, large = graphs
    b1, b2 = small.meta.batch_size, large.meta.batch_size
    assert b1 is not None and b2 is not None
    nearest = small if abs(batch_size - b1) <= abs(batch_size - b2) else large

    def at(v1: float, v2: float, growing: bool = False) -> float:
        return _line(batch_size, b1, v1, b2, v2, growing)

    def node(n: Node) -> Node:
        a, z = small[n.id], large[n.id]
        changes: dict[str, float | int] = {k: int(round(at(getattr(a, k), getattr(z, k)))) for k in _BYTES}
        changes.update({k: at(getattr(a, k), getattr(z, k), growing=True) for k in _TIMES})
        return replace(n, **changes)  # type: ignore[arg-type]

    meta = nearest.meta.copy()
    meta.batch_size = batch_size
    if small.meta.input_bytes is not None and large.meta.input_bytes is not None:
        meta.input_bytes = int(round(at(small.meta.input_bytes, large.meta.input_bytes)))
    if small.meta.saved_input_bytes is not None and large.meta.saved_input_bytes is not None:
        keys = set(small.meta.saved_input_bytes) | set(large.meta.saved_input_bytes)
        meta.saved_input_bytes = {
            k: int(round(at(small.meta.saved_input_bytes.get(k, 0), large.meta.saved_input_bytes.get(k, 0))))
            for k in sorted(keys)}
    if small.meta.plain_peak_bytes and large.meta.plain_peak_bytes and b1 <= batch_size <= b2:
        # The peak is the largest of the step's moments, each affine in the batch: a convex
        # function, which the chord bounds from above between the two sizes and from below
        # outside them (where a later moment's activations overtake the one that peaked).
        # Outside, it is left to the simulator (None).
        meta.plain_peak_bytes = int(round(at(small.meta.plain_peak_bytes, large.meta.plain_peak_bytes)))
    else:
        meta.plain_peak_bytes = None
    if small.meta.loss_peak_bytes is not None and large.meta.loss_peak_bytes is not None:
        meta.loss_peak_bytes = max(0, int(round(at(small.meta.loss_peak_bytes, large.meta.loss_peak_bytes))))
    else:
        meta.loss_peak_bytes = None
    if small.meta.output_grad_bytes is not None and large.meta.output_grad_bytes is not None:
        meta.output_grad_bytes = max(0, int(round(at(small.meta.output_grad_bytes,
                                                     large.meta.output_grad_bytes))))
    else:
        meta.output_grad_bytes = None
    if small.meta.step_seconds and large.meta.step_seconds:
        meta.step_seconds = at(small.meta.step_seconds, large.meta.step_seconds, growing=True)
    # A vertex grows with the batch when its bytes do.
    meta.batch_dependent = {n.id: (small[n.id].mem, small[n.id].saved) != (large[n.id].mem, large[n.id].saved)
                            for n in nearest.nodes}
    return Graph([node(n) for n in nearest.nodes], list(nearest.edges), meta)
