"""AdaRound: adaptive weight rounding (Nagel et al. 2020, "Up or Down? Adaptive Rounding for
Post-Training Quantization").

Round-to-nearest is not the best rounding of a layer's weights: what matters is the layer's output.
AdaRound chooses, per weight, the code below or above ``w / scale`` on the device's own weight grid
(quant/scheme.py: per-tensor uint8 on cpu and dsp, per-output-channel int8 on gpu; the scale and
zero point are the scheme's, unchanged) so that the layer's output on calibration inputs moves least:

    minimise  ||(W~ - W) X||^2 / E  +  lambda * sum(1 - |2 h(V) - 1|^beta)
    W~ = scale * (floor(w / scale + zp) + h(V) - zp),   h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1)

with ``X`` the layer's float input patches (im2col, one column per sampled output position) from
the calibration images and ``E = ||W X||^2 / N`` the layer's output energy per weight (``N``
weights), so that ``lambda`` weighs each weight's share of the error against its regulariser term.
The loss is quadratic in ``W~``: ``G = X X^T`` (``K x K``, ``K = Cin/groups * kh * kw``, one per
group; a depthwise convolution has one ``kh*kw`` matrix per channel) is accumulated once per layer,
then ``||dW X||^2 = trace(dW G dW^T)`` and its gradient is ``2 dW G``. Adam on ``V``, ``beta``
annealed (cosine) from 20 to 2 after a 20% warm-up without the regulariser; at the end ``h >= 0.5``
rounds up. Each layer is optimised on float inputs, independently.

The result is stored per device as float weights *on the chosen grid values* (``Calibration.device_weights``):
the writer's own quantization (the scheme's ``weights``) then gives back exactly the chosen codes. The
grid must not move: the elements that hold the tensor's (gpu: the channel's) minimum and maximum keep
their float value and their round-to-nearest code, and every other code stays within the codes of
those two, so the scheme's range, scale and zero point are unchanged. This is checked for every
layer (an error, not a silent difference, if the scheme would give other codes).

Conv (depthwise and grouped included) and Gemm/MatMul with constant weights, in uint8, are rounded;
ConvTranspose, float32 layers (mixed precision) and layers whose weights are not constant are left alone.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import numpy as np
from maceq.app.bias_correction import _Layer, _layers, ir_layout, mace_layout
from maceq.calibrate.runner import BatchedSession, expose_outputs, make_session
from maceq.errors import MaceqError
from maceq.quant.build import check_supported
from maceq.quant.ir import Graph
from maceq.quant.scheme import scheme_for
from maceq.runtime.devices import Device
from tqdm import tqdm

__all__ = ["AdaRoundResult", "RoundingProblem", "adaround", "check_options", "conv_gram", "gram_matrices",
           "layer_problem", "loss_and_grad", "low_rank_factor", "optimize", "optimize_v", "rectified_sigmoid",
           "rounding_layers", "snap_weights"]

ZETA, GAMMA = 1.1, -0.1
LAMBDA = 0.01
BETA_START, BETA_END, WARMUP = 20.0, 2.0, 0.2
LEARNING_RATE = 0.05
MAX_POSITIONS = 4096  # output positions sampled per image and layer
SEED = 0


def rectified_sigmoid(v: np.ndarray) -> np.ndarray:
    """h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1)."""
    return np.clip(_sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)


def _sigmoid(v):
    return 0.5 * (1.0 + np.tanh(0.5 * v))  # = 1 / (1 + exp(-v)), without overflow


def _inverse_h(h: np.ndarray) -> np.ndarray:
    """V with h(V) == h for h in (0, 1) (h is clipped a little inside so that V stays finite)."""
    h = np.clip(h, 1e-4, 1.0 - 1e-4)
    return -np.log((ZETA - GAMMA) / (h - GAMMA) - 1.0)


# -- one layer's rounding problem -----------------------------------------------------------------


@dataclass
class RoundingProblem:
    """One layer on one device's grid, grouped: arrays ``[groups, O/groups, K]`` (``G``: ``[groups, K, K]``).

    ``base`` is the lower code (``floor(w / scale + zp)``); ``free`` marks the weights that may take
    ``base + 1``; fixed weights keep ``base`` (which holds their code). ``norm`` scales the reconstruction
    term (weights per unit of output energy)."""

    w: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    base: np.ndarray
    free: np.ndarray
    gram: np.ndarray
    norm: float
    per_channel: bool = False
    rtn: np.ndarray | None = None  # the scheme's round-to-nearest codes
    factor: np.ndarray | None = None  # F with G = F F^T, [groups, K, r], when the rank r is well below K

    def gram_product(self, dw: np.ndarray) -> np.ndarray:
        """dW G (through the low-rank factor when there is one)."""
        if self.factor is not None:
            return np.matmul(np.matmul(dw, self.factor), self.factor.transpose(0, 2, 1))
        return np.matmul(dw, self.gram)

    def astype(self, dtype) -> "RoundingProblem":
        """The same problem with its arrays in ``dtype`` (float32 for the optimisation loop)."""
        cast = [None if a is None else np.asarray(a, dtype) for a in
                (self.w, self.scale, self.zero_point, self.base, self.free, self.gram, self.factor)]
        return RoundingProblem(*cast[:6], self.norm, self.per_channel, self.rtn, cast[6])

    def weights(self, h: np.ndarray) -> np.ndarray:
        return self.scale * (self.base + h * self.free - self.zero_point)

    def reconstruction(self, codes: np.ndarray) -> float:
        """||(W~ - W) X||^2 for integer codes (the unnormalised term)."""
        dw = self.scale * (codes - self.zero_point) - self.w
        return float(np.einsum("gok,gkl,gol->", dw, self.gram, dw))

    def nearest(self) -> np.ndarray:
        """Round-to-nearest codes, as the scheme gives them."""
        if self.rtn is not None:
            return self.rtn
        frac = (self.w / self.scale + self.zero_point) - self.base
        return self.base + (frac >= 0.5) * self.free

    def initial_v(self) -> np.ndarray:
        frac = np.clip(self.w / self.scale + self.zero_point - self.base, 0.0, 1.0)
        return np.where(self.free, _inverse_h(frac), 0.0)


def loss_and_grad(p: RoundingProblem, v: np.ndarray, *, beta: float | None, lam: float = LAMBDA,
                  with_loss: bool = True):
    """(loss, dloss/dV): ``norm * trace(dW G dW^T) + lam * sum(1 - |2h - 1|^beta)`` over the free weights;
    ``beta=None``: no regulariser (the warm-up). ``with_loss=False`` skips the loss (None)."""
    s = _sigmoid(v)
    hr = s * (ZETA - GAMMA) + GAMMA
    h = np.clip(hr, 0.0, 1.0)
    dw = p.weights(h) - p.w
    dwg = p.gram_product(dw)
    loss = p.norm * float(np.sum(dwg * dw)) if with_loss else None
    grad_h = (2.0 * p.norm) * dwg * p.scale
    if beta is not None:
        t = 2.0 * h - 1.0
        a = np.abs(t)
        a_b1 = a ** (beta - 1.0)
        if with_loss:
            loss += lam * float(np.sum((1.0 - a_b1 * a) * p.free))
        grad_h -= (2.0 * lam * beta) * a_b1 * np.sign(t)
    mask = ((hr > 0.0) & (hr < 1.0)) * p.free
    return loss, grad_h * (s * (1.0 - s)) * ((ZETA - GAMMA) * mask)


def optimize(p: RoundingProblem, *, iters: int, lr: float = LEARNING_RATE, lam: float = LAMBDA) -> np.ndarray:
    """AdaRound's codes for ``p``: :func:`optimize_v`, then h(V) >= 0.5 rounds up."""
    if not np.any(p.free) or p.norm == 0.0:
        return p.nearest()
    v = optimize_v(p, iters=iters, lr=lr, lam=lam)
    return p.base + (rectified_sigmoid(v) >= 0.5) * (p.free > 0)


def optimize_v(p: RoundingProblem, *, iters: int, lr: float = LEARNING_RATE, lam: float = LAMBDA) -> np.ndarray:
    """V after ``iters`` Adam steps from h(V) = the fractional part (float32 loop; returned as float64)."""
    v = p.initial_v().astype(np.float32)
    p = p.astype(np.float32)
    m = np.zeros_like(v)
    u = np.zeros_like(v)
    b1, b2, eps = 0.9, 0.999, 1e-8
    warm = int(WARMUP * iters)
    for it in range(iters):
        beta = None
        if it >= warm:
            t = (it - warm) / max(iters - warm, 1)
            beta = float(BETA_END + 0.5 * (BETA_START - BETA_END) * (1.0 + np.cos(np.pi * t)))
        _, g = loss_and_grad(p, v, beta=beta, lam=lam, with_loss=False)
        m = b1 * m + (1 - b1) * g
        u = b2 * u + (1 - b2) * g * g
        v = v - lr * (m / (1 - b1 ** (it + 1))) / (np.sqrt(u / (1 - b2 ** (it + 1))) + eps)
    return v.astype(np.float64)


def low_rank_factor(gram: np.ndarray) -> np.ndarray | None:
    """F with ``gram ~= F F^T`` (eigenvalues above 1e-10 of the largest kept) when its rank is at most a
    quarter of K (a Gemm on fewer images than inputs); otherwise None."""
    k = gram.shape[-1]
    if k < 64:
        return None
    vals, vecs = np.linalg.eigh(gram)
    keep = vals > 1e-10 * max(float(vals.max()), 1e-300)
    r = int(keep.sum(axis=-1).max())
    if r > k // 4:
        return None
    idx = np.argsort(vals, axis=-1)[:, ::-1][:, :r]
    sel_vals = np.take_along_axis(vals, idx, axis=-1)
    sel_vecs = np.take_along_axis(vecs, idx[:, None, :], axis=-1)
    return sel_vecs * np.sqrt(np.maximum(sel_vals, 0.0))[:, None, :]


def _grid(lay: _Layer, device: Device, in_channels: int | None):
    """The device scheme's grid for ``lay``, in IR layout: (codes, scale, zero point, the real-valued
    code w / scale + zp, per_channel). The codes and parameters are the scheme's own (quant/scheme.py)."""
    w_mace, depthwise = mace_layout(lay, in_channels)
    w32 = w_mace.astype(np.float32)
    qw = scheme_for(device).weights(w32, out_axis_last_two=depthwise)
    codes = qw.codes.astype(np.float64)
    if qw.params is not None:  # per-tensor affine uint8: round(zp + w / scale), scale in float64
        scale = np.full(codes.shape, float(qw.params.scale))
        zp = np.full(codes.shape, float(qw.params.zero_point))
        real = zp + w32.astype(np.float64) / scale
    else:  # symmetric per-channel int8: rint(f32(w / scale)), scales in float32
        s32 = qw.channel_scales.astype(np.float32)
        s32 = s32.reshape(codes.shape[2], codes.shape[3]) if depthwise else s32.reshape((-1,) + (1,) * 3)
        real = (w32 / s32).astype(np.float64)
        scale = np.broadcast_to(s32.astype(np.float64), codes.shape).copy()
        zp = np.zeros(codes.shape)
    ir = [ir_layout(a, lay, depthwise) for a in (codes, scale, zp, real)]
    return (*ir, qw.params is None, depthwise)


def layer_problem(lay: _Layer, device: "Device | str", gram: np.ndarray, *,
                  in_channels: int | None = None) -> RoundingProblem:
    """The rounding problem of ``lay`` on ``device``'s weight grid, with ``gram`` = ``X X^T`` per group."""
    codes, scale, zp, real, per_channel, _ = _grid(lay, Device.parse(device), in_channels)
    w = lay.w.astype(np.float32).astype(np.float64)
    flat = w.reshape(w.shape[0], -1)
    axis = 1 if per_channel else None
    lo_w, hi_w = flat.min(axis=axis, keepdims=True), flat.max(axis=axis, keepdims=True)
    c2 = codes.reshape(flat.shape)
    extreme = (flat == lo_w) | (flat == hi_w)
    # the codes allowed: those between the codes of the extremes, which keep their float value
    lo_c = np.where(flat == lo_w, c2, np.inf).min(axis=axis, keepdims=True)
    hi_c = np.where(flat == hi_w, c2, -np.inf).max(axis=axis, keepdims=True)
    base = np.floor(real.reshape(flat.shape))
    ok = (c2 == base) | (c2 == base + 1)  # the scheme's code is one of floor, floor + 1
    free = ~extreme & ok & (base >= lo_c) & (base + 1 <= hi_c)
    base = np.where(free, base, c2)
    groups = gram.shape[0]
    shape = (groups, flat.shape[0] // groups, flat.shape[1])
    arrs = [a.reshape(shape) for a in (flat, scale.reshape(flat.shape), zp.reshape(flat.shape), base)]
    energy = float(np.einsum("gok,gkl,gol->", arrs[0], gram, arrs[0]))
    norm = flat.size / energy if energy > 0 else 0.0
    return RoundingProblem(arrs[0], arrs[1], arrs[2], arrs[3], free.reshape(shape).astype(np.float64),
                           np.asarray(gram, dtype=np.float64), norm, per_channel, c2.reshape(shape),
                           low_rank_factor(np.asarray(gram, dtype=np.float64)))


def snap_weights(lay: _Layer, p: RoundingProblem, codes: np.ndarray, device: Device,
                 in_channels: int | None) -> np.ndarray:
    """Float32 weights (IR layout of ``lay.w``) on the grid values of ``codes``, which the device scheme
    quantizes back to exactly ``codes`` with the same scale and zero point (checked)."""
    w = lay.w.astype(np.float32)
    snapped = (p.scale * (codes - p.zero_point)).reshape(w.shape).astype(np.float32)
    fixed = (p.free == 0).reshape(w.shape)
    flat, sflat = w.reshape(w.shape[0], -1), snapped.reshape(w.shape[0], -1)
    axis = 1 if p.per_channel else None
    lo, hi = flat.min(axis=axis, keepdims=True), flat.max(axis=axis, keepdims=True)
    sflat = np.clip(sflat, lo, hi)  # a grid value past the extreme element's is that element's code
    snapped = np.where(fixed, w, sflat.reshape(w.shape))
    got, want = _grid(_with_w(lay, snapped), device, in_channels), _grid(_with_w(lay, w), device, in_channels)
    if not np.array_equal(got[0].reshape(codes.shape), codes) or not np.array_equal(got[1], want[1]) \
            or not np.array_equal(got[2], want[2]):
        raise MaceqError(f"adaround: layer '{lay.node}': the {device.value} scheme does not give back the chosen "
                         f"codes from the snapped weights")
    return snapped


def _with_w(lay: _Layer, w: np.ndarray) -> _Layer:
    return replace(lay, w=np.asarray(w, np.float64))


# -- the layers' inputs: G = X X^T --------------------------------------------------------------


def conv_gram(x: np.ndarray, lay: _Layer, *, rng: np.random.Generator | None = None,
              max_positions: int = MAX_POSITIONS) -> tuple[np.ndarray, int]:
    """(sum over images and sampled output positions of ``p p^T`` per group, ``[groups, K, K]``; the
    number of positions), ``p`` the input patch a position reads (zero padding included), ordered as
    ``lay.w[o]`` flattens (input channel, ky, kx). At most ``max_positions`` positions per image,
    drawn without replacement by ``rng`` (all of them without ``rng`` or when fewer)."""
    x = np.asarray(x, dtype=np.float64)
    n, c, h, w = x.shape
    _, cg, kh, kw = lay.w.shape
    top, left, bottom, right = lay.pads
    (sh, sw), (dh, dw) = lay.strides, lay.dilations
    oh = (h + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (w + left + right - dw * (kw - 1) - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    groups = c // cg
    gram = np.zeros((groups, cg * kh * kw, cg * kh * kw))
    count = 0
    for i in range(n):
        idx = np.arange(oh * ow)
        if rng is not None and idx.size > max_positions:
            idx = np.sort(rng.choice(idx.size, max_positions, replace=False))
        oy, ox = np.divmod(idx, ow)
        rows = (oy[:, None] * sh + np.arange(kh)[None, :] * dh)[:, :, None]
        cols = (ox[:, None] * sw + np.arange(kw)[None, :] * dw)[:, None, :]
        patch = xp[i][:, rows, cols]  # [C, P, kh, kw]
        patch = patch.reshape(groups, cg, idx.size, kh * kw).transpose(0, 2, 1, 3).reshape(groups, idx.size, -1)
        gram += np.matmul(patch.transpose(0, 2, 1), patch)
        count += idx.size
    return gram, count


def gram_matrices(graph: Graph, layers: list[_Layer], batches, *, max_positions: int = MAX_POSITIONS,
                  seed: int = SEED, progress: bool = False) -> tuple[dict[str, np.ndarray], int]:
    """(``X X^T`` per group of each layer's float input, from onnxruntime on ``graph``; the images read)."""
    in_name = graph.inputs[0].name
    names = [t for t in dict.fromkeys(lay.x for lay in layers) if t != in_name]
    # a model that fixes its batch gets the batches in chunks it takes
    sess = BatchedSession(make_session(expose_outputs(graph.to_onnx(), names), optimize=False), in_name)
    grams: dict[str, np.ndarray] = {}
    rngs = {lay.node: np.random.default_rng([seed, i]) for i, lay in enumerate(layers)}
    n_img = 0
    for batch in tqdm(batches, desc="adaround inputs", unit="batch", leave=False,
                      disable=not progress or not sys.stderr.isatty()):
        got = dict(zip(names, sess.run(names, {in_name: batch.data}, what="the float model (adaround inputs)")))
        got[in_name] = batch.data
        n_img += batch.data.shape[0]
        for lay in layers:
            x = np.asarray(got[lay.x], dtype=np.float64)
            if lay.kind == "gemm":
                xf = x.reshape(x.shape[0], -1)
                g = (xf.T @ xf)[None]
            else:
                g, _ = conv_gram(x, lay, rng=rngs[lay.node], max_positions=max_positions)
            grams[lay.node] = grams[lay.node] + g if lay.node in grams else g
    return grams, n_img


# -- per device, the whole model ------------------------------------------------------------------


@dataclass
class AdaRoundResult:
    """One device's rounding: the snapped float32 weights by IR node name (in the node's own weight
    layout, a Gemm's alpha folded in), the chosen codes (IR layout) and the record."""

    device: Device
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    codes: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    images: int = 0
    changed: int = 0  # weights whose code differs from round-to-nearest
    total: int = 0
    error_nearest: list[float] = field(default_factory=list)  # per layer, ||dW X||^2 / ||W X||^2
    error_adaround: list[float] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict:
        def mean_db(errs):
            errs = [e for e in errs if e > 0]
            return float(np.mean([-10 * np.log10(e) for e in errs])) if errs else 0.0
        return {"device": self.device.value, "layers": len(self.weights), "images": self.images,
                "changed_weights": self.changed, "weights": self.total,
                "mean_layer_sqnr_nearest_db": mean_db(self.error_nearest),
                "mean_layer_sqnr_adaround_db": mean_db(self.error_adaround),
                "skipped": [{"node": n, "reason": r} for n, r in self.skipped]}


def rounding_layers(g: Graph, placement: dict[str, str]) -> tuple[list[_Layer], list[tuple[str, str]]]:
    """(the uint8 Conv/Gemm/MatMul layers with constant weights, the (node, reason) of those skipped)."""
    layers = _layers(g, placement)
    skipped = []
    for n in g.nodes:
        if placement.get(n.name) != "uint8":
            continue
        if n.op_type == "MatMul" and g.is_const(n.inputs[1]) and g.const(n.inputs[1]).ndim == 2:
            w = np.asarray(g.const(n.inputs[1]), np.float64).T
            layers.append(_Layer(n.name, "gemm", n.inputs[0], n.outputs[0], w, np.zeros(w.shape[0])))
        elif n.op_type == "ConvTranspose":
            skipped.append((n.name, "ConvTranspose is not rounded adaptively"))
    return layers, skipped


def _node_layout(g: Graph, node_name: str, w_ir: np.ndarray) -> np.ndarray:
    """The IR-layout weights of a layer in its node's own weight layout (Gemm without transB, MatMul: [K, O])."""
    node = next(n for n in g.nodes if n.name == node_name)
    if node.op_type == "MatMul" or (node.op_type == "Gemm" and not node.attr("transB", 0)):
        return np.ascontiguousarray(w_ir.T)
    return w_ir


def check_options(*, iters: int = 500, images: int = 64) -> None:
    """Refuse, naming the config key, an option AdaRound cannot run with (before any long work)."""
    for key, value in (("adaround_iters", iters), ("adaround_images", images)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise MaceqError(f"{key} must be a positive integer, got {value!r}")


def adaround(graph: Graph, shapes: dict, *, devices, data, fp32_nodes=frozenset(), iters: int = 500,
             batch_size: int = 8, progress: bool = False) -> dict[str, AdaRoundResult]:
    """AdaRound of ``graph``'s uint8 layers for each device, on the images of ``data`` (an ImageFolder).

    The inputs are collected once (float, shared by the devices); each device rounds on its own grid.
    Returns ``{device: AdaRoundResult}``; ``graph`` is not modified."""
    check_options(iters=iters)
    devs = [Device.parse(d) for d in devices]
    per_dev = {}
    for d in devs:
        placement = check_supported(graph, device=d, shapes=shapes, fp32=set(fp32_nodes))
        per_dev[d] = rounding_layers(graph, placement)
    union = list({lay.node: lay for layers, _ in per_dev.values() for lay in layers}.values())
    results = {d.value: AdaRoundResult(d, skipped=per_dev[d][1]) for d in devs}
    if not union:
        return results
    grams, n_img = gram_matrices(graph, union, data.iter_batches(batch_size), progress=progress)
    if n_img == 0:
        raise MaceqError("adaround: no image could be read")
    for d in devs:
        res = results[d.value]
        res.images = n_img
        for lay in tqdm(per_dev[d][0], desc=f"adaround ({d.value})", unit="layer", leave=False,
                        disable=not progress or not sys.stderr.isatty()):
            _round_layer(graph, shapes, lay, d, grams[lay.node], iters, res)
    return results


def _round_layer(graph: Graph, shapes: dict, lay: _Layer, device: Device, gram: np.ndarray, iters: int,
                 res: AdaRoundResult) -> None:
    shape = shapes.get(lay.x)
    in_ch = shape[1] if shape is not None and len(shape) > 1 else None
    p = layer_problem(lay, device, gram, in_channels=in_ch)
    codes = optimize(p, iters=iters)
    nearest = p.nearest()
    snapped = snap_weights(lay, p, codes, device, in_ch)
    res.weights[lay.node] = _node_layout(graph, lay.node, snapped)
    res.codes[lay.node] = codes.reshape(lay.w.shape)
    res.changed += int(np.sum(codes != nearest))
    res.total += int(codes.size)
    energy = p.w.size / p.norm if p.norm else 0.0
    if energy:
        res.error_nearest.append(p.reconstruction(nearest) / energy)
        res.error_adaround.append(p.reconstruction(codes) / energy)
