"""Write the ResNet-50 and DenseNet-121 profiles (224 x 224 px, batch 32, float32) that the
offloading tests and ``benchmarks/offload.py`` read: ``resnet50_224.json`` and
``densenet121_224.json`` beside this script, in the Graph JSON form.

No torchvision needed: the layer shapes are the torchvision architectures' (written out
below), and the costs come from them with a simple device model, a V100-class GPU like the
one of the paper's section 6.1:

- bytes: float32 outputs; ``saved`` and ``meta['saved_refs']`` as autograd keeps them (conv
  and linear keep their input, BatchNorm its input plus two per-channel statistics, ReLU its
  output, max-pool its input plus int64 indices, add / cat / average-pool nothing);
- time: convolutions and linear layers at ``FLOPS`` (forward), backward twice the forward;
  element-wise ops bound by memory traffic at ``HBM`` bytes/s, backward 1.5x;
- bandwidth ``BETA`` = 12.2 GB/s, the paper's measured GPU-to-host figure.

Run once: ``python tests/data/make_cnn_profiles.py`` (deterministic; re-running rewrites the
same files).
"""

from __future__ import annotations

import json
from pathlib import Path

BATCH = 32
FLOPS = 10e12  # effective float32 conv throughput
HBM = 700e9  # effective device memory bandwidth, bytes/s
BETA = 12.2e9  # host <-> device, bytes/s (paper section 6.1)
F32 = 4


class Builder:
    def __init__(self) -> None:
        self.nodes: list[dict] = []
        self.edges: list[list[str]] = []
        self.refs: dict[str, list[str]] = {}
        self.shape: dict[str, tuple[int, int, int]] = {}

    def bytes_of(self, c: int, h: int, w: int) -> int:
        return BATCH * c * h * w * F32

    def add(self, nid: str, op: str, inputs: list[str], shape: tuple[int, int, int],
            t_fwd: float, t_bwd: float, refs: list[str], extra_saved: int = 0) -> str:
        mem = self.bytes_of(*shape)
        saved = sum(mem if r == nid else self.node(r)["mem"] for r in refs) + extra_saved
        self.nodes.append({"id": nid, "op": op, "mem": mem, "saved": saved, "t_fwd": t_fwd,
                           "t_bwd": t_bwd, "ws_fwd": 0, "ws_bwd": 0})
        self.edges += [[u, nid] for u in inputs]
        self.refs[nid] = refs
        self.shape[nid] = shape
        return nid

    def node(self, nid: str) -> dict:
        return next(n for n in self.nodes if n["id"] == nid)

    def in_shape(self, src: str | None) -> tuple[int, int, int]:
        return (3, 224, 224) if src is None else self.shape[src]

    # ---- layers -------------------------------------------------------------------------
    def conv(self, nid: str, src: str | None, cout: int, k: int, stride: int = 1) -> str:
        cin, h, w = self.in_shape(src)
        pad = k // 2
        ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        flops = 2 * BATCH * cin * cout * k * k * ho * wo
        t = flops / FLOPS
        return self.add(nid, "Conv2d", [src] if src else [], (cout, ho, wo), t, 2 * t,
                        [src] if src else [])

    def bn(self, nid: str, src: str) -> str:
        c, h, w = self.shape[src]
        t = 3 * self.bytes_of(c, h, w) / HBM
        return self.add(nid, "BatchNorm2d", [src], (c, h, w), t, 1.5 * t, [src], 2 * c * F32)

    def relu(self, nid: str, src: str) -> str:
        shape = self.shape[src]
        t = 2 * self.bytes_of(*shape) / HBM
        return self.add(nid, "ReLU", [src], shape, t, 1.5 * t, [nid])

    def maxpool(self, nid: str, src: str) -> str:
        c, h, w = self.shape[src]
        out = (c, (h + 2 - 3) // 2 + 1, (w + 2 - 3) // 2 + 1)
        t = (self.bytes_of(c, h, w) + self.bytes_of(*out)) / HBM
        return self.add(nid, "MaxPool2d", [src], out, t, 1.5 * t, [src], 2 * self.bytes_of(*out))

    def avgpool(self, nid: str, src: str, size: int | None = None) -> str:
        c, h, w = self.shape[src]
        out = (c, 1, 1) if size is None else (c, h // size, w // size)
        t = (self.bytes_of(c, h, w) + self.bytes_of(*out)) / HBM
        return self.add(nid, "AvgPool2d", [src], out, t, 1.5 * t, [])

    def add_op(self, nid: str, a: str, b: str) -> str:
        shape = self.shape[a]
        t = 3 * self.bytes_of(*shape) / HBM
        return self.add(nid, "add", [a, b], shape, t, t, [])

    def cat(self, nid: str, a: str, b: str) -> str:
        ca, h, w = self.shape[a]
        cb = self.shape[b][0]
        t = 2 * self.bytes_of(ca + cb, h, w) / HBM
        return self.add(nid, "cat", [a, b], (ca + cb, h, w), t, t, [])

    def linear(self, nid: str, src: str, out: int) -> str:
        cin = self.shape[src][0]
        t = 2 * BATCH * cin * out / FLOPS
        return self.add(nid, "Linear", [src], (out, 1, 1), t, 2 * t, [src])

    def graph(self, name: str) -> dict:
        return {"nodes": self.nodes, "edges": self.edges, "meta": {
            "model": name, "batch_size": BATCH, "image_size": 224, "dtype": "float32",
            "device": "model of a V100-class GPU (tests/data/make_cnn_profiles.py)",
            "bandwidth_bytes_per_s": BETA, "saved_refs": self.refs,
            "outputs": [self.nodes[-1]["id"]], "input_bytes": BATCH * 3 * 224 * 224 * F32,
        }}


def resnet50() -> dict:
    b = Builder()
    x = b.conv("conv1", None, 64, 7, 2)
    x = b.relu("relu", b.bn("bn1", x))
    x = b.maxpool("maxpool", x)
    for li, (blocks, width, stride) in enumerate([(3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)]):
        for bi in range(blocks):
            p = f"layer{li + 1}.{bi}"
            s = stride if bi == 0 else 1
            identity = x
            h = b.relu(f"{p}.relu1", b.bn(f"{p}.bn1", b.conv(f"{p}.conv1", x, width, 1)))
            h = b.relu(f"{p}.relu2", b.bn(f"{p}.bn2", b.conv(f"{p}.conv2", h, width, 3, s)))
            h = b.bn(f"{p}.bn3", b.conv(f"{p}.conv3", h, 4 * width, 1))
            if bi == 0:
                identity = b.bn(f"{p}.downsample.1", b.conv(f"{p}.downsample.0", x, 4 * width, 1, s))
            x = b.relu(f"{p}.relu3", b.add_op(f"{p}.add", h, identity))
    x = b.avgpool("avgpool", x)
    b.linear("fc", x, 1000)
    return b.graph("resnet50")


def densenet121() -> dict:
    b = Builder()
    x = b.conv("features.conv0", None, 64, 7, 2)
    x = b.relu("features.relu0", b.bn("features.norm0", x))
    x = b.maxpool("features.pool0", x)
    for bi, layers in enumerate((6, 12, 24, 16)):
        for li in range(layers):
            p = f"features.denseblock{bi + 1}.denselayer{li + 1}"
            h = b.relu(f"{p}.relu1", b.bn(f"{p}.norm1", x))
            h = b.relu(f"{p}.relu2", b.bn(f"{p}.norm2", b.conv(f"{p}.conv1", h, 4 * 32, 1)))
            h = b.conv(f"{p}.conv2", h, 32, 3)
            x = b.cat(f"{p}.cat", x, h)
        if bi < 3:
            p = f"features.transition{bi + 1}"
            h = b.relu(f"{p}.relu", b.bn(f"{p}.norm", x))
            h = b.conv(f"{p}.conv", h, b.shape[h][0] // 2, 1)
            x = b.avgpool(f"{p}.pool", h, 2)
    x = b.relu("features.relu5", b.bn("features.norm5", x))
    x = b.avgpool("avgpool", x)
    b.linear("classifier", x, 1000)
    return b.graph("densenet121")


def main() -> None:
    here = Path(__file__).parent
    for name, build in (("resnet50_224", resnet50), ("densenet121_224", densenet121)):
        (here / f"{name}.json").write_text(json.dumps(build(), indent=None, separators=(",", ":")))


if __name__ == "__main__":
    main()
