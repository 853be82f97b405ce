"""Graphs for the solver benchmarks (``benchmarks/solvers.py``).

Synthetic shapes (costs drawn from a seeded RNG so every run sees the same graph):
``chain_graph``, ``resnet_like_graph`` (blocks of four ops with a skip edge around each),
``densenet_like_dag`` (dense blocks where every op reads every earlier op of its block) and
``densenet_like_graph`` (DenseNet-201's layer structure with float32 activation sizes; a copy
of the generator in ``tests/test_feng.py``).

Profiled graphs: ``profile_model(name)`` traces and profiles a real model on the CPU at small
sizes (``PROFILED`` lists them) and ``profiled_graph(name)`` reads the JSON cached under
``benchmarks/graphs/`` (profiling only when the file is missing or ``reprofile`` is set).
torchvision models need the interpreter that has torchvision (``/work/main/.venv-vision``).
"""

from __future__ import annotations

import random
from pathlib import Path

from lightning_remat.graph.ir import Graph, Node

GRAPH_DIR = Path(__file__).resolve().parent / "graphs"

# name -> (batch, description). Sizes a 2-core CPU profiles in a few minutes, yet large
# enough that activations, not parameter gradients, are most of the peak (except VGG-19,
# whose 548 MiB of gradients would need far larger batches to be outweighed).
IMAGE_SIZE = 128
PROFILED: dict[str, tuple[int, str]] = {
    "resnet50": (16, "torchvision resnet50, batch 16, 3x128x128 images, 1000 classes"),
    "vgg19": (16, "torchvision vgg19, batch 16, 3x128x128 images, 1000 classes"),
    "densenet121": (16, "torchvision densenet121, batch 16, 3x128x128 images, 1000 classes"),
    "gpt": (8, "GPT (benchmarks.models): vocab 8192, width 256, 4 blocks, 4 heads, "
               "256 tokens, batch 8"),
}


def _random_costs(rng: random.Random) -> tuple[int, float]:
    """One vertex's activation bytes (4 KiB .. 256 KiB) and forward seconds (0.1 .. 2 ms)."""
    return rng.randint(1, 64) * 4096, rng.uniform(1e-4, 2e-3)


def _node(name: str, rng: random.Random) -> Node:
    nbytes, seconds = _random_costs(rng)
    return Node(name, "op", mem=nbytes, saved=nbytes, t_fwd=seconds, t_bwd=2 * seconds)


def chain_graph(n: int, seed: int = 0) -> Graph:
    """A chain of ``n`` vertices with random costs."""
    rng = random.Random(seed)
    return Graph([_node(f"n{i}", rng) for i in range(n)],
                 [(f"n{i - 1}", f"n{i}") for i in range(1, n)])


def resnet_like_graph(n: int, seed: int = 0) -> Graph:
    """``n`` vertices in residual blocks: a -> b -> c -> add, plus a skip edge from the
    previous block's output to ``add`` (like ResNet's basic blocks)."""
    rng = random.Random(seed)
    nodes: list[Node] = []
    edges: list[tuple[str, str]] = []
    previous_out: str | None = None
    i = 0
    while i < n:
        block = []
        for _ in range(min(4, n - i)):
            nodes.append(_node(f"n{i}", rng))
            block.append(f"n{i}")
            i += 1
        tail = previous_out
        for nid in block:
            if tail is not None:
                edges.append((tail, nid))
            tail = nid
        if previous_out is not None and len(block) == 4:
            edges.append((previous_out, block[-1]))  # the skip connection
        previous_out = block[-1]
    return Graph(nodes, edges)


def densenet_like_dag(n: int, block: int = 24, seed: int = 0) -> Graph:
    """``n`` vertices in dense blocks of ``block`` ops: each op reads the block's input and
    every earlier op of its block; a transition op reads them all and starts the next block."""
    rng = random.Random(seed)
    nodes: list[Node] = []
    edges: list[tuple[str, str]] = []
    transition: str | None = None
    i = 0
    while i < n:
        members = [] if transition is None else [transition]
        for _ in range(min(block, n - i)):
            nid = f"n{i}"
            nodes.append(_node(nid, rng))
            i += 1
            edges.extend((u, nid) for u in members)
            members.append(nid)
        if i < n:
            nid = f"n{i}"
            nodes.append(_node(nid, rng))
            i += 1
            edges.extend((u, nid) for u in members)
            transition = nid
    return Graph(nodes, edges)


def densenet_like_graph(
    blocks: tuple[int, ...] = (6, 12, 48, 32), growth: int = 32, batch: int = 16, width: int = 56
) -> Graph:
    """A DenseNet-shaped graph (DenseNet-201 by default: 711 vertices, 2513 edges): a stem,
    dense blocks where layer k concatenates the block input and every earlier layer's output
    (cat -> BN -> ReLU -> 1x1 conv -> BN -> ReLU -> 3x3 conv), the block output concatenating
    all of them, transitions, a head. Costs are float32 bytes of the activations.
    (tests/test_feng.py builds its DenseNet-201-size case with it.)"""
    nodes: list[Node] = []
    edges: list[tuple[str, str]] = []

    def add(name: str, op: str, channels: int, hw: int, preds: list[str] | tuple = ()) -> str:
        nbytes = 4 * batch * channels * hw * hw
        nodes.append(Node(name, op, mem=nbytes, saved=nbytes, t_fwd=1e-4, t_bwd=2e-4))
        edges.extend((p, name) for p in preds)
        return name

    hw = 2 * width
    x = add("conv0", "Conv2d", 64, hw)
    x = add("norm0", "BatchNorm2d", 64, hw, [x])
    x = add("relu0", "ReLU", 64, hw, [x])
    hw = width
    x = add("pool0", "MaxPool2d", 64, hw, [x])
    channels = 64
    for b, layers in enumerate(blocks):
        features = [x]
        for k in range(1, layers + 1):
            c_in = channels + growth * (k - 1)
            y = add(f"b{b}l{k}_cat", "cat", c_in, hw, list(features))
            y = add(f"b{b}l{k}_norm1", "BatchNorm2d", c_in, hw, [y])
            y = add(f"b{b}l{k}_relu1", "ReLU", c_in, hw, [y])
            y = add(f"b{b}l{k}_conv1", "Conv2d", 4 * growth, hw, [y])
            y = add(f"b{b}l{k}_norm2", "BatchNorm2d", 4 * growth, hw, [y])
            y = add(f"b{b}l{k}_relu2", "ReLU", 4 * growth, hw, [y])
            y = add(f"b{b}l{k}_conv2", "Conv2d", growth, hw, [y])
            features.append(y)
        channels += growth * layers
        x = add(f"b{b}_out", "cat", channels, hw, features)
        if b < len(blocks) - 1:
            x = add(f"t{b}_norm", "BatchNorm2d", channels, hw, [x])
            x = add(f"t{b}_relu", "ReLU", channels, hw, [x])
            channels //= 2
            x = add(f"t{b}_conv", "Conv2d", channels, hw, [x])
            hw //= 2
            x = add(f"t{b}_pool", "AvgPool2d", channels, hw, [x])
    x = add("norm5", "BatchNorm2d", channels, hw, [x])
    x = add("relu5", "ReLU", channels, hw, [x])
    x = add("pool5", "AdaptiveAvgPool2d", channels, 1, [x])
    x = add("flatten", "flatten", channels, 1, [x])
    add("fc", "Linear", 1000, 1, [x])
    return Graph(nodes, edges)


def profile_model(name: str) -> Graph:
    """Trace and profile one model of ``PROFILED`` on the CPU (one warm-up, three repeats)."""
    import torch

    from benchmarks.models import GPT, WithLoss
    from lightning_remat.graph.profile import profile_module

    if name not in PROFILED:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(PROFILED)}")
    torch.manual_seed(0)
    batch, _ = PROFILED[name]
    if name == "gpt":
        model = GPT(vocab=8192, width=256, depth=4, heads=4, context=256)
        x = torch.randint(0, 8192, (batch, 256))
        y = torch.randint(0, 8192, (batch, 256))
    else:
        try:
            import torchvision
        except ImportError as exc:
            raise RuntimeError(f"profiling {name} needs torchvision: run with "
                               "/work/main/.venv-vision/bin/python") from exc
        model = getattr(torchvision.models, name)(num_classes=1000)
        x = torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE)
        y = torch.randint(0, 1000, (batch,))
    module = WithLoss(model, sequence=name == "gpt").train()
    graph = profile_module(module, (x, y), loss_fn=lambda out: out, warmup=1, repeats=3)
    graph.meta.extra["model"] = PROFILED[name][1]
    return graph


def profiled_graph(name: str, reprofile: bool = False) -> Graph:
    """The cached profiled graph of ``name`` (``benchmarks/graphs/<name>.json``), profiling
    and saving it first when missing or when ``reprofile`` is set."""
    path = GRAPH_DIR / f"{name}.json"
    if reprofile or not path.exists():
        graph = profile_model(name)
        GRAPH_DIR.mkdir(parents=True, exist_ok=True)
        graph.save(path)
    return Graph.load(path)
