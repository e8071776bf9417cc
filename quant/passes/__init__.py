"""Graph optimisation passes, one module each, run in a fixed order by :func:`optimize`."""
from __future__ import annotations

from maceq.quant.ir import Graph
from maceq.quant.passes.activation import fuse_activations
from maceq.quant.passes.arith import arith_to_conv, batchnorm_to_conv
from maceq.quant.passes.autopad import explicit_pads
from maceq.quant.passes.batchnorm import fold_batchnorm
from maceq.quant.passes.constants import fold_constants
from maceq.quant.passes.identity import remove_identities
from maceq.quant.passes.pad import fold_pad
from maceq.quant.passes.qkv import split_qkv

__all__ = ["optimize", "explicit_pads", "fold_constants", "remove_identities", "fold_batchnorm", "fold_pad", "fuse_activations",
           "arith_to_conv", "batchnorm_to_conv", "split_qkv"]


def optimize(graph: Graph, input_shapes: dict[str, list[int]]) -> Graph:
    """Return an optimised copy: constants folded, Identity/Dropout removed, ``auto_pad`` made
    explicit ``pads``, attention q/k/v splits through a rank-5 tensor rewritten into rank-4 ops,
    BatchNormalization folded into Conv/Gemm, Pad folded into Conv, per-channel constant
    arithmetic and lone BatchNormalization turned into depthwise Conv, Relu/Clip fused."""
    g = graph.copy()
    remove_identities(g)
    fold_constants(g, input_shapes)
    if any(str(n.attr("auto_pad", "NOTSET") or "NOTSET") != "NOTSET" or int(n.attr("ceil_mode", 0) or 0)
           for n in g.nodes):
        explicit_pads(g, g.infer_shapes(input_shapes))
    for name in split_qkv(g, input_shapes):
        g.rewrites.append(f"'{name}': attention q/k/v split through a rank-5 Transpose, rewritten exactly into "
                          f"rank-4 Slice/Reshape/Transpose per part")
    fold_batchnorm(g)
    fold_pad(g)
    shapes = g.infer_shapes(input_shapes)
    arith_to_conv(g, shapes)
    batchnorm_to_conv(g, shapes)
    g.toposort()
    fold_batchnorm(g)
    fuse_activations(g)
    g.remove_unused()
    g.toposort()
    return g
