"""device.py: the default budget counts what the caching allocator holds unused as free."""

import torch

from lightning_remat.device import default_budget, module_device


def test_default_budget_counts_cached_but_unused_memory_as_available(monkeypatch):
    # Right after profiling, the caching allocator still holds the plain step's peak:
    # free memory alone would count the package's own cache as used.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 8000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)
    assert default_budget(torch.device("cuda", 0)) == int((1000 + 2000) * 0.9)
    assert default_budget(torch.device("cpu")) is None


def test_module_device_falls_back_to_the_inputs_then_the_cpu():
    assert module_device(torch.nn.Linear(2, 2)) == torch.device("cpu")
    assert module_device(torch.nn.ReLU(), [torch.zeros(1, device="meta")]) == torch.device("meta")
    assert module_device(torch.nn.ReLU()) == torch.device("cpu")


def test_move_to_device_moves_every_tensor_and_keeps_each_containers_type():
    from collections import OrderedDict, namedtuple

    from lightning_remat.device import move_to_device

    Pair = namedtuple("Pair", "logits aux")
    value = OrderedDict(out=Pair(torch.zeros(2), [torch.ones(1), 3]), name="x")
    moved = move_to_device(value, torch.device("meta"))
    assert type(moved) is OrderedDict and list(moved) == ["out", "name"]
    assert type(moved["out"]) is Pair and isinstance(moved["out"].aux, list)
    assert moved["out"].logits.device.type == "meta" and moved["out"].aux[0].device.type == "meta"
    assert moved["out"].aux[1] == 3 and moved["name"] == "x"


def test_the_cuda_margin_counts_cached_blocks_handed_out_whole_unless_segments_expand(monkeypatch):
    from lightning_remat.graph.ir import Graph
    from lightning_remat.solvers.scoring import CUDA_BLOCK_BYTES, expandable_segments, model_margin

    graph = Graph.chain([3 * 2**20, 2**19, 5 * 2**20])
    graph.meta.device = "cuda:0"
    rounding = CUDA_BLOCK_BYTES * 3 * len(graph)
    # Two values of the large pool, each may get a cached block up to 1 MiB larger.
    assert model_margin(graph, expandable=False) == rounding + 2 * 2**20
    assert model_margin(graph, expandable=True) == rounding
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert expandable_segments() and model_margin(graph) == rounding
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert not expandable_segments() and model_margin(graph) == rounding + 2 * 2**20
    graph.meta.device = "cpu"
    assert model_margin(graph, expandable=False) == model_margin(graph, expandable=True)
