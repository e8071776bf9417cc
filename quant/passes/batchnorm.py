"""Fold BatchNormalization into the preceding Conv or Gemm (float64, then float32)."""
from __future__ import annotations

import numpy as np

from maceq.quant.ir import Graph


def fold_batchnorm(g: Graph) -> int:
    folded = 0
    producers, consumers = g.producers(), g.consumers()
    for bn in list(g.nodes):
        if bn.op_type != "BatchNormalization":
            continue
        if not all(g.is_const(i) for i in bn.inputs[1:5]):
            continue
        prod = producers.get(bn.inputs[0])
        if prod is None or prod.op_type not in ("Conv", "Gemm") or len(consumers.get(bn.inputs[0], [])) != 1:
            continue
        if prod.attrs.get("maceq_act") is not None or bn.inputs[0] in g.outputs:
            continue
        if not g.is_const(prod.inputs[1]) or (len(prod.inputs) > 2 and prod.inputs[2] and not g.is_const(prod.inputs[2])):
            continue
        gamma, beta, mean, var = (g.const(i).astype(np.float64) for i in bn.inputs[1:5])
        eps = float(bn.attr("epsilon", 1e-5))
        s = gamma / np.sqrt(var + eps)
        w = g.const(prod.inputs[1]).astype(np.float64)
        if prod.op_type == "Conv":
            w = w * s.reshape(-1, *([1] * (w.ndim - 1)))
        else:
            if prod.attr("transB", 0):
                w = w * s[:, None]
            else:
                w = w * s[None, :]
        b = g.const(prod.inputs[2]).astype(np.float64) if len(prod.inputs) > 2 and prod.inputs[2] else np.zeros_like(s)
        b = (b - mean) * s + beta
        wname, bname = prod.inputs[1] + "__bnfold", bn.name + "__bias"
        g.initializers[wname] = w.astype(np.float32)
        g.initializers[bname] = b.astype(np.float32)
        prod.inputs = [prod.inputs[0], wname, bname]
        prod.outputs = [bn.outputs[0]]
        g.nodes.remove(bn)
        folded += 1
        producers, consumers = g.producers(), g.consumers()
    return folded
