"""Fold BatchNormalization into the preceding Conv or Gemm (float64, then float32)."""
from __future__ import annotations

import numpy as np

from maceq.errors import MaceqError
from maceq.quant.ir import Graph


def _out_channels(prod, w: np.ndarray) -> int | None:
    """Output channels of the Conv (OIHW: dim 0) or Gemm (B is [K, N], or [N, K] with transB)."""
    if prod.op_type == "Conv":
        return int(w.shape[0]) if w.ndim >= 1 else None
    if w.ndim != 2:
        return None
    return int(w.shape[0] if prod.attr("transB", 0) else w.shape[1])


def fold_batchnorm(g: Graph) -> int:
    """Fold each BatchNormalization whose parameters are constant into the Conv/Gemm before it.

    The four parameter tensors (scale, B, mean, var) must each hold one value per output channel
    of that Conv/Gemm, and a bias it has one per channel too: anything else (the model is not
    valid ONNX) raises MaceqError naming the two nodes. A node with fewer than five inputs (only
    possible in a graph built without quant.onnx_import, whose schema check rejects it) is left
    alone.
    """
    folded = 0
    producers, consumers = g.producers(), g.consumers()
    for bn in list(g.nodes):
        if bn.op_type != "BatchNormalization":
            continue
        if len(bn.inputs) < 5 or not all(i and g.is_const(i) for i in bn.inputs[1:5]):
            continue
        prod = producers.get(bn.inputs[0])
        if prod is None or prod.op_type not in ("Conv", "Gemm") or len(consumers.get(bn.inputs[0], [])) != 1:
            continue
        if prod.attrs.get("maceq_act") is not None or bn.inputs[0] in g.outputs:
            continue
        if len(prod.inputs) < 2 or not g.is_const(prod.inputs[1]) or (
                len(prod.inputs) > 2 and prod.inputs[2] and not g.is_const(prod.inputs[2])):
            continue
        w = g.const(prod.inputs[1]).astype(np.float64)
        channels = _out_channels(prod, w)
        params = [np.asarray(g.const(i)) for i in bn.inputs[1:5]]
        if len(prod.inputs) > 2 and prod.inputs[2]:
            params.append(np.asarray(g.const(prod.inputs[2])))
        for k, (what, p) in enumerate(zip(("scale", "B", "mean", "var", f"{prod.op_type} bias"), params)):
            if k == 4 and prod.op_type == "Gemm" and channels is not None:
                ok = p.ndim <= 2 and all(d == 1 for d in p.shape[:-1]) and (p.ndim == 0 or p.shape[-1] in (1, channels))
            else:
                ok = channels is not None and p.shape == (channels,)
            if not ok:
                raise MaceqError(
                    f"node '{bn.name}' (BatchNormalization): {what} has shape {list(p.shape)}, but "
                    f"'{prod.name}' ({prod.op_type}) has "
                    + (f"{channels} output channels" if channels is not None
                       else f"a weight of shape {list(w.shape)}"))
        gamma, beta, mean, var = (p.astype(np.float64) for p in params[:4])
        eps = float(bn.attr("epsilon", 1e-5))
        s = gamma / np.sqrt(var + eps)
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
