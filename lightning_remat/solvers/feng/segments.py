"""The paper's objective (Feng & Huang, eq. 1) on any graph: the re-forward segments of a
stored set and their cost (docs/design.md section 4.2).

With V_R fixed, a segment is a connected set of non-stored vertices; the paper's optimality
claim assumes (section 4.1, assumption 1) that every segment of the solution has exactly one
source and one target endpoint, i.e. is a closed set (Definition 1) between two stored
vertices. :func:`two_endpoint_segments` tests that condition; :func:`objective` evaluates
eq. 1 for any stored set (segments = connected components of the non-stored vertices).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_remat.graph.ir import Graph

__all__ = ["Segment", "objective", "segments", "two_endpoint_segments"]


# ---- the paper's objective on any graph ----------------------------------------------------

_SOURCE = "<inputs>"
_TARGET = "<loss>"


@dataclass
class Segment:
    """A connected set of non-stored vertices and the stored vertices around it."""

    nodes: list[str]
    cost: int
    sources: set[str]
    """Stored vertices with an edge into the segment (``<inputs>`` for the step's inputs)."""
    targets: set[str]
    """Stored vertices the segment has an edge into (``<loss>`` for the loss)."""


def segments(graph: Graph, stored: Iterable[str]) -> list[Segment]:
    """The re-forward segments of a stored set: connected components (through edges in
    either direction) of the vertices not stored, in topological order of their first
    vertex."""
    stored_set = set(stored)
    unknown = stored_set - set(graph.ids)
    if unknown:
        raise ValueError(f"stored names vertices not in the graph: {sorted(unknown)[:8]}")
    seen: set[str] = set()
    found: list[Segment] = []
    for start in graph.ids:
        if start in stored_set or start in seen:
            continue
        seen.add(start)
        members = [start]
        sources: set[str] = set()
        targets: set[str] = set()
        stack = [start]
        while stack:
            v = stack.pop()
            # Upstream the segment's sources, downstream its targets: a stored neighbour is
            # an end, the graph's own edge the virtual source or target; the rest joins it.
            for neighbours, ends, outside in ((graph.predecessors(v), sources, _SOURCE),
                                              (graph.successors(v), targets, _TARGET)):
                if not neighbours:
                    ends.add(outside)
                for u in neighbours:
                    if u in stored_set:
                        ends.add(u)
                    elif u not in seen:
                        seen.add(u)
                        members.append(u)
                        stack.append(u)
        members.sort(key=graph.position)
        found.append(Segment(members, int(graph.total("mem", members)), sources, targets))
    found.sort(key=lambda s: graph.position(s.nodes[0]))
    return found


def objective(graph: Graph, stored: Iterable[str]) -> int:
    """Eq. 1 for a stored set: the stored vertices' ``mem`` plus the largest segment cost."""
    stored_set = set(stored)
    largest = max((s.cost for s in segments(graph, stored_set)), default=0)
    return int(graph.total("mem", stored_set)) + largest


def two_endpoint_segments(graph: Graph, stored: Iterable[str]) -> bool:
    """Whether every segment has one source and one target (the paper's assumption 1,
    section 4.1: the segments are closed sets between two stored vertices)."""
    return all(len(s.sources) == 1 and len(s.targets) == 1 for s in segments(graph, stored))
