"""Cross-layer equalization (CLE) and high-bias absorption (HBA) on the optimised float IR.

Nagel, van Baalen, Blankevoort, Welling, "Data-Free Quantization Through Weight Equalization
and Bias Correction" (ICCV 2019), sections 4.1 (equalization) and 4.2 (absorbing high biases);
the reference implementation read for it is quic/aimet
ModelOptimizations/DlEqualization/src/{ScaleFactorCalculator,CrossLayerScaling,HighBiasFold}.cpp.

What the pass does (the full rule set, with the measurements, is in docs/recovery.md):

* **Chains.** A *link* is a pair P -> C of Conv/Gemm layers whose connecting tensor has one
  consumer and is not a graph output: P's output feeds C directly, or (C a Gemm) through
  GlobalAveragePool -> Flatten/Reshape. P's fused activation (``maceq_act``) must be none,
  ReLU (0, inf) or a bounded ReLU (0, hi) such as ReLU6; Conv layers are plain (group 1) or
  depthwise (group == in == out channels). Links sharing a layer form chains, e.g.
  expand 1x1 -> depthwise 3x3 -> project 1x1 (AIMET's "depthwise-separable triplet").
* **Equalization.** Channel i of link j gets a positive scale S_j[i]: P's output channel i
  (weights and bias) is divided by S_j[i], C's input channel i is multiplied by it. For a
  depthwise layer output channel i is input channel i, so the scales of its two links meet in
  the same kernel. Per-channel weight range r = max |w| (AIMET's computeRangeAlongFirstAxis).
  One link update is Nagel's s_i = sqrt(r1_i * r2_i) / r2_i, after which r1_i == r2_i; the
  links of a chain are swept in order until no scale changes by more than ``tolerance``
  (relative) or ``iterations`` sweeps ran. The fixed point of a depthwise triplet is AIMET's
  closed form r1 = r2 = r3 = cbrt(r1 r2 r3).
* **Exactness.** ReLU is positively homogeneous, so any S > 0 keeps the float function. A
  bounded ReLU clip(x, 0, hi) is not: channel i's clip would become hi*S[i], which a
  per-tensor clamp cannot express. Channel i may move only when its pre-activation x_i provably
  stays below the clip, x_i <= u_i < hi, and then only with S[i] >= max(u_i, 0) / hi, so the
  scaled channel x_i / S[i] never reaches the clip either (and S[i] > 1 never lets a clipping
  value through). Every other channel keeps S[i] = 1. The bound u_i comes from
  - ``relu6="exact"``: interval arithmetic on P's weights when P's input is the output of a
    clamp (lo, hi) (u_i = b_i + sum_k max(w_ik lo, w_ik hi), the input interval widened to
    hold the zero padding): true for every input, no data needed;
  - ``relu6="calibrated"``: that, or ``headroom`` times the channel's maximum over the
    calibration images (``channel_stats``), whichever is smaller; a channel never positive
    there gets S[i] >= 1 (never amplified). Exact on the calibration images; on other images
    while their pre-activations stay within the headroom (docs/recovery.md measures it);
  - ``relu6="replace"``: AIMET's data-free rule, the bounded ReLU of each link becomes ReLU and
    every channel is free (this changes the float function where the clamp was active).
* **High-bias absorption** (``absorb_bias``): with c_i >= 0 a lower bound of P's scaled
  pre-activation, relu(x) = relu(x - c) + c for x >= c, so c moves from P's bias into C's bias
  (b_C += sum_k W_C[:, i, k] c_i). ReLU and free bounded-ReLU channels (they never reach the clip,
  so clip(x - c, 0, hi) = x - c): c_i = the interval lower bound (``exact``), or the larger of
  it and min - (headroom - 1) * (max - min) over the calibration images (``calibrated``,
  ``replace``). No activation: c_i = the midpoint of the observed range, exact for every input
  (needs ``channel_stats``). C's zero padding breaks the identity at image borders (a padded
  zero stands for x = c after the shift), so C must have no padding unless ``absorb_padded``.

The pass mutates the graph in place (as the other passes do) and returns an
:class:`EqualizeReport`. Arithmetic is float64 from the float32 weights, rounded to float32 once.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

import numpy as np

from maceq.calibrate.runner import BatchedSession, _feed, expose_outputs, make_session
from maceq.errors import MaceqError
from maceq.quant.ir import ACT_ATTR, Graph, Node

__all__ = ["Relu6Mode", "ActKind", "ChannelStats", "LinkReport", "LayerRange", "EqualizeReport", "equalize",
           "collect_channel_stats", "preactivation_name"]

#: ir.Graph.to_onnx names the pre-activation of a node with a fused clamp ``<output>`` + this suffix.
PREACT_SUFFIX = "__maceq_preact"


class Relu6Mode(Enum):
    """How a link whose activation is a bounded ReLU (ReLU6) is equalized."""

    EXACT = "exact"            # keep the clamp; move only channels proven below it for every input
    CALIBRATED = "calibrated"  # ... or below it on the calibration images, with headroom
    REPLACE = "replace"        # AIMET's data-free rule: ReLU6 -> ReLU, then scale freely (changes the function)


class ActKind(Enum):
    LINEAR = "linear"
    RELU = "relu"
    BOUNDED = "bounded_relu"  # clip(x, 0, hi), hi finite (ReLU6: hi = 6)


class _LayerKind(Enum):
    CONV = "conv"            # group 1: weight [O, I, *k]
    DEPTHWISE = "depthwise"  # group == I == O: weight [O, 1, *k], out channel i reads in channel i
    GEMM = "gemm"            # weight stored [O, I] (transB=1) or [I, O]


@dataclass(frozen=True)
class ChannelStats:
    """Per-channel minimum and maximum of a Conv/Gemm layer's pre-activation output (channel axis 1)."""

    lo: np.ndarray
    hi: np.ndarray

    def merged(self, other: "ChannelStats") -> "ChannelStats":
        return ChannelStats(np.minimum(self.lo, other.lo), np.maximum(self.hi, other.hi))


@dataclass(frozen=True)
class LinkReport:
    producer: str            # node names
    consumer: str
    activation: str          # ActKind value, after a ReLU6 replacement
    channels: int
    scale_min: float         # range of the final scales S (P's channel i divided by S[i])
    scale_max: float
    fixed_channels: int      # held at S = 1 by the ReLU6 rule
    proven_channels: int     # free by the interval bound (bounded ReLU links)
    bound_channels: int      # ended on the ReLU6 lower bound
    absorbed_channels: int   # channels with a nonzero absorbed bias c_i
    absorb_note: str = ""    # why nothing was absorbed, when so


@dataclass(frozen=True)
class LayerRange:
    """Per-tensor weight quantization quality of one layer: ``grid_use`` is the mean over output
    channels of r_o / R (channel range over tensor range), the share of the per-tensor uint8 grid
    an average channel uses (Nagel's precision measure)."""

    node: str
    grid_use_before: float
    grid_use_after: float
    range_before: float      # R = max |w| of the tensor
    range_after: float


@dataclass(frozen=True)
class EqualizeReport:
    links: tuple[LinkReport, ...]
    layers: tuple[LayerRange, ...]
    skipped: tuple[tuple[str, str], ...]   # (node or tensor, reason)
    relu6_replaced: tuple[str, ...]        # nodes whose (0, hi) clamp became ReLU
    sweeps: int
    converged: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [f"cross-layer equalization: {len(self.links)} links in {self.sweeps} sweeps"
               f"{'' if self.converged else ' (not converged)'}, {len(self.relu6_replaced)} ReLU6 replaced"]
        for ln in self.links:
            out.append(f"  {ln.producer} -> {ln.consumer} [{ln.activation}] S in [{ln.scale_min:.3g}, "
                       f"{ln.scale_max:.3g}], fixed {ln.fixed_channels}/{ln.channels}, proven {ln.proven_channels}, "
                       f"bound {ln.bound_channels}, "
                       f"absorbed {ln.absorbed_channels}{' (' + ln.absorb_note + ')' if ln.absorb_note else ''}")
        for name, why in self.skipped:
            out.append(f"  skipped {name}: {why}")
        return out


# -- structure -------------------------------------------------------------------------------


@dataclass
class _Layer:
    node: Node
    kind: _LayerKind
    w: np.ndarray            # float64, [O, I, *k] (Gemm: [O, I]; depthwise: [O, 1, *k])
    b: np.ndarray            # float64 [O] (zeros when the node has none)
    amax: np.ndarray = field(init=False)  # max |w| over the kernel: [O, I], depthwise [O]

    def __post_init__(self) -> None:
        a = np.abs(self.w)
        if self.kind is _LayerKind.DEPTHWISE:
            self.amax = a.reshape(a.shape[0], -1).max(axis=1)
        else:
            self.amax = a.reshape(a.shape[0], a.shape[1], -1).max(axis=2)

    @property
    def out_channels(self) -> int:
        return self.w.shape[0]

    @property
    def in_channels(self) -> int:
        return self.w.shape[0] if self.kind is _LayerKind.DEPTHWISE else self.w.shape[1]

    def ranges(self, s_in: np.ndarray | None, s_out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(per-output-channel, per-input-channel) max |w| of the weights scaled as
        w[o, i] * s_in[i] / s_out[o]."""
        if self.kind is _LayerKind.DEPTHWISE:
            v = self.amax * (1.0 if s_in is None else s_in) / (1.0 if s_out is None else s_out)
            return v, v
        m = self.amax
        if s_in is not None:
            m = m * s_in[None, :]
        if s_out is not None:
            m = m / s_out[:, None]
        return m.max(axis=1), m.max(axis=0)


@dataclass
class _Link:
    p: _Layer
    c: _Layer
    act: ActKind
    clip_hi: float                   # the bound of a BOUNDED activation, else inf
    tensor: str                      # P's output tensor (its fused activation's output)
    padded: bool                     # C zero-pads its input
    pre_lo: np.ndarray               # interval bounds of P's pre-activation over every input
    pre_hi: np.ndarray
    scale: np.ndarray = field(init=False)
    lower: np.ndarray = field(init=False)
    upper: np.ndarray = field(init=False)
    absorbed: np.ndarray | None = None
    absorb_note: str = ""
    free: np.ndarray = field(init=False)  # bounded ReLU: channels that never reach the clip
    proven: int = 0

    def __post_init__(self) -> None:
        n = self.p.out_channels
        self.free = np.ones(n, dtype=bool)
        self.scale = np.ones(n)
        self.lower = np.zeros(n)
        self.upper = np.full(n, np.inf)


def _bias_of(g: Graph, node: Node, n_out: int) -> np.ndarray | None:
    if len(node.inputs) > 2 and node.inputs[2]:
        if not g.is_const(node.inputs[2]):
            return None
        b = np.asarray(g.const(node.inputs[2]), dtype=np.float64)
        if b.size != n_out:
            return None
        return b.reshape(n_out).copy()
    return np.zeros(n_out)


def _layer(g: Graph, node: Node) -> tuple[_Layer | None, str]:
    """The node as an equalizable layer, or None and the reason."""
    if node.op_type not in ("Conv", "Gemm"):
        return None, f"{node.op_type} is not Conv/Gemm"
    if len(node.inputs) < 2 or not g.is_const(node.inputs[1]):
        return None, "weights are not constant"
    w = np.asarray(g.const(node.inputs[1]), dtype=np.float64)
    if node.op_type == "Gemm":
        if w.ndim != 2 or node.attr("transA", 0):
            return None, "Gemm with transA or non-2-D weights"
        if float(node.attr("alpha", 1.0)) != 1.0 or float(node.attr("beta", 1.0)) != 1.0:
            return None, "Gemm with alpha or beta != 1"
        w = w if node.attr("transB", 0) else w.T
        kind = _LayerKind.GEMM
    else:
        if w.ndim < 3:
            return None, "Conv weights of rank < 3"
        group = int(node.attr("group", 1))
        if group == 1:
            kind = _LayerKind.CONV
        elif w.shape[1] == 1 and w.shape[0] == group:
            kind = _LayerKind.DEPTHWISE
        else:
            return None, f"grouped Conv (group {group}, weight {tuple(w.shape)})"
    b = _bias_of(g, node, w.shape[0])
    if b is None:
        return None, "bias is not a constant vector"
    return _Layer(node, kind, w, b), ""


def _activation(node: Node) -> tuple[ActKind | None, float]:
    act = node.attrs.get(ACT_ATTR)
    if act is None:
        return ActKind.LINEAR, math.inf
    lo, hi = float(act[0]), float(act[1])
    if lo != 0.0 or not hi > 0.0:
        return None, hi
    return (ActKind.RELU, math.inf) if math.isinf(hi) else (ActKind.BOUNDED, hi)


def _follow(g: Graph, tensor: str, consumers: dict[str, list[Node]], n_channels: int
            ) -> tuple[Node | None, str]:
    """The one layer that reads ``tensor`` (through GlobalAveragePool -> Flatten/Reshape for a
    Gemm), or None and the reason."""
    path = tensor
    hops = 0
    while True:
        if path in g.outputs:
            return None, f"'{path}' is a graph output"
        cons = consumers.get(path, [])
        if len(cons) != 1:
            return None, f"'{path}' has {len(cons)} consumers"
        nxt = cons[0]
        if nxt.inputs[0] != path or path in nxt.inputs[1:]:
            return None, f"'{path}' is not the data input of {nxt.op_type} '{nxt.name}'"
        if nxt.op_type in ("Conv", "Gemm"):
            if hops and nxt.op_type != "Gemm":
                return None, f"Conv '{nxt.name}' after GlobalAveragePool"
            return nxt, ""
        if hops == 0 and nxt.op_type == "GlobalAveragePool":
            hops = 1
        elif hops == 1 and nxt.op_type == "Flatten" and int(nxt.attr("axis", 1)) == 1:
            hops = 2
        elif hops == 1 and nxt.op_type == "Reshape" and _to_batch_by_channels(g, nxt, n_channels):
            hops = 2
        else:
            return None, f"consumer {nxt.op_type} '{nxt.name}' is not an equalizable layer"
        path = nxt.outputs[0]


def _to_batch_by_channels(g: Graph, reshape: Node, n_channels: int) -> bool:
    """A Reshape of [N, C, 1, 1] to [N, C] (target [N|0|1|-1, C] or [N|0|1, -1])."""
    if len(reshape.inputs) < 2 or not g.is_const(reshape.inputs[1]):
        return False
    shape = [int(v) for v in np.asarray(g.const(reshape.inputs[1])).ravel()]
    return len(shape) == 2 and ((shape[0] >= 0 and shape[1] in (-1, n_channels))
                                or (shape[0] == -1 and shape[1] == n_channels))


def _is_padded(node: Node) -> bool:
    if node.op_type != "Conv":
        return False
    if node.attr("auto_pad", "NOTSET") not in ("NOTSET", "", "VALID"):
        return True
    return any(int(p) != 0 for p in node.attr("pads", []))


def _find_links(g: Graph) -> tuple[list[_Link], list[tuple[str, str]]]:
    consumers, producers = g.consumers(), g.producers()
    layers: dict[int, _Layer] = {}
    links: list[_Link] = []
    skipped: list[tuple[str, str]] = []
    for node in g.nodes:
        if node.op_type not in ("Conv", "Gemm"):
            continue
        p = layers.get(id(node))
        if p is None:
            p, why = _layer(g, node)
            if p is None:
                skipped.append((node.name, why))
                continue
            layers[id(node)] = p
        act, hi = _activation(node)
        if act is None:
            skipped.append((node.name, f"activation clip{tuple(node.attrs[ACT_ATTR])} is not a (bounded) ReLU"))
            continue
        nxt, why = _follow(g, node.outputs[0], consumers, p.out_channels)
        if nxt is None:
            skipped.append((node.name, why))
            continue
        c = layers.get(id(nxt))
        if c is None:
            c, why = _layer(g, nxt)
            if c is None:
                skipped.append((node.name, f"consumer '{nxt.name}': {why}"))
                continue
            layers[id(nxt)] = c
        if c.in_channels != p.out_channels:
            skipped.append((node.name, f"{p.out_channels} output channels feed {c.in_channels} inputs of '{nxt.name}'"))
            continue
        links.append(_Link(p, c, act, hi, node.outputs[0], _is_padded(nxt), *_interval(p, producers.get(node.inputs[0]))))
    return links, skipped


def _interval(layer: _Layer, src: Node | None) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of the layer's pre-activation over every input, from the clamp (lo, hi) of the node
    that produces its input (widened to hold 0, the zero padding); +-inf without one."""
    n = layer.out_channels
    act = src.attrs.get(ACT_ATTR) if src is not None else None
    if act is None:
        return np.full(n, -np.inf), np.full(n, np.inf)
    a, b = min(float(act[0]), 0.0), max(float(act[1]), 0.0)
    pos = np.maximum(layer.w, 0.0).reshape(n, -1).sum(axis=1)
    neg = np.minimum(layer.w, 0.0).reshape(n, -1).sum(axis=1)

    def dot(weight_sum: np.ndarray, x: float) -> np.ndarray:  # weight_sum * x with 0 * inf = 0
        return np.where(weight_sum == 0.0, 0.0, weight_sum * x)

    return layer.b + dot(pos, a) + dot(neg, b), layer.b + dot(pos, b) + dot(neg, a)


def _chains(links: list[_Link]) -> list[list[_Link]]:
    """Links grouped into chains (each layer has at most one link out and, being single-input,
    one link in), in graph order."""
    by_p = {id(ln.p.node): ln for ln in links}
    has_in = {id(ln.c.node) for ln in links}
    chains = []
    for ln in links:
        if id(ln.p.node) in has_in:
            continue
        chain = [ln]
        while id(chain[-1].c.node) in by_p:
            chain.append(by_p[id(chain[-1].c.node)])
        chains.append(chain)
    return chains


# -- the pass --------------------------------------------------------------------------------


def _grid_use(w: np.ndarray) -> tuple[float, float]:
    r = np.abs(w).reshape(w.shape[0], -1).max(axis=1)
    big = float(r.max()) if r.size else 0.0
    return (float(np.mean(r / big)) if big > 0 else 1.0), big


def equalize(graph: Graph, *, relu6: Relu6Mode | str = Relu6Mode.EXACT,
             channel_stats: Mapping[str, ChannelStats] | None = None, headroom: float = 2.0,
             absorb_bias: bool = True, absorb_padded: bool = False, iterations: int = 100,
             tolerance: float = 1e-7) -> EqualizeReport:
    """Cross-layer equalization, then high-bias absorption, in place on an optimised graph.

    ``channel_stats``: from :func:`collect_channel_stats` on this graph (before the pass), keyed by
    the Conv/Gemm node's output tensor; used by ``relu6="calibrated"`` and by the bias absorption
    (a link without its statistics is treated as in ``exact`` mode and absorbs no midpoint).
    ``headroom`` (>= 1): how far beyond the calibration range (a factor on the maximum, a multiple
    of the width below the minimum) held-out pre-activations are assumed to stay; 1 proves
    exactness on the calibration images only. ``iterations``: the most sweeps over the chains;
    ``tolerance``: stop when no scale changes by a factor farther than this from 1.
    """
    mode = _checked_relu6_mode(relu6, iterations, tolerance, headroom)
    stats = dict(channel_stats or {})
    links, skipped = _find_links(graph)
    use_data = mode is not Relu6Mode.EXACT
    replaced = _apply_relu6_rule(links, mode, stats, headroom, skipped)
    sweeps, converged = _balance_scales(links, iterations, tolerance)
    layers, before = _scale_weights(links)
    if absorb_bias:
        for ln in links:
            _absorb(ln, stats if use_data else {}, stats, headroom=headroom, absorb_padded=absorb_padded)
    for layer in layers.values():
        _store(graph, layer)
    return EqualizeReport(_link_reports(links), _layer_ranges(layers, before), tuple(skipped), tuple(replaced),
                          sweeps, converged)


def _checked_relu6_mode(relu6: Relu6Mode | str, iterations: int, tolerance: float, headroom: float) -> Relu6Mode:
    """The Relu6Mode that ``relu6`` names, once the numeric arguments of :func:`equalize` are checked too."""
    try:
        mode = Relu6Mode(relu6.value if isinstance(relu6, Relu6Mode) else str(relu6))
    except ValueError:
        raise MaceqError(f"equalize: relu6 must be one of {', '.join(m.value for m in Relu6Mode)}, "
                         f"got {relu6!r}") from None
    if not (isinstance(iterations, int) and iterations >= 1):
        raise MaceqError(f"equalize: iterations must be a positive int, got {iterations!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0.0):
        raise MaceqError(f"equalize: tolerance must be a finite number >= 0, got {tolerance!r}")
    if not (math.isfinite(headroom) and headroom >= 1.0):
        raise MaceqError(f"equalize: headroom must be a finite number >= 1, got {headroom!r}")
    return mode


def _apply_relu6_rule(links: list[_Link], mode: Relu6Mode, stats: Mapping[str, ChannelStats], headroom: float,
                      skipped: list[tuple[str, str]]) -> list[str]:
    """Replace each bounded ReLU's clamp or bound its channels' scales (noting in ``skipped``); the replaced nodes."""
    use_data = mode is not Relu6Mode.EXACT
    replaced: list[str] = []
    for ln in links:
        if ln.act is not ActKind.BOUNDED:
            continue
        if mode is Relu6Mode.REPLACE:
            ln.p.node.attrs[ACT_ATTR] = (0.0, math.inf)
            ln.act, ln.clip_hi = ActKind.RELU, math.inf
            replaced.append(ln.p.node.name)
            continue
        ln.free = ln.pre_hi < ln.clip_hi
        ln.proven = int(np.count_nonzero(ln.free))
        lower = np.maximum(ln.pre_hi, 0.0) / ln.clip_hi
        st = _stats_for(stats, ln) if use_data else None
        if st is not None:
            data_free = headroom * st.hi < ln.clip_hi
            data_lower = np.where(st.hi > 0, headroom * st.hi / ln.clip_hi, 1.0)
            lower = np.where(ln.free & data_free, np.minimum(lower, data_lower), np.where(ln.free, lower, data_lower))
            ln.free = ln.free | data_free
        elif use_data:
            skipped.append((ln.p.node.name, f"bounded ReLU (0, {ln.clip_hi:g}) without channel_stats: "
                                            "interval bounds only"))
        ln.lower = np.where(ln.free, lower, 1.0)
        ln.upper = np.where(ln.free, np.inf, 1.0)
    return replaced


def _balance_scales(links: list[_Link], iterations: int, tolerance: float) -> tuple[int, bool]:
    """Sweep the chains, setting each link's scales to balance its two layers' ranges; (sweeps, converged)."""
    chains = _chains(links)
    sweeps, converged = 0, not links
    for sweeps in range(1, iterations + 1):
        worst = 0.0
        for chain in chains:
            for j, ln in enumerate(chain):
                s_in_p = chain[j - 1].scale if j > 0 else None
                s_out_c = chain[j + 1].scale if j + 1 < len(chain) else None
                r1, _ = ln.p.ranges(s_in_p, ln.scale)
                _, r2 = ln.c.ranges(ln.scale, s_out_c)
                ok = (r1 > 0) & (r2 > 0)
                s = np.where(ok, np.sqrt(np.where(ok, r1, 1.0) / np.where(ok, r2, 1.0)), 1.0)
                new = np.clip(ln.scale * s, ln.lower, ln.upper)
                worst = max(worst, float(np.max(np.abs(np.log(new / ln.scale)))) if new.size else 0.0)
                ln.scale = new
        if worst <= tolerance:
            converged = True
            break
    return sweeps, converged


def _scale_weights(links: list[_Link]) -> tuple[dict[int, _Layer], dict[int, tuple[float, float]]]:
    """Scale the linked layers' weights and biases by the final scales; the layers, and each one's grid use before."""
    before = {}
    s_in: dict[int, np.ndarray] = {}
    s_out: dict[int, np.ndarray] = {}
    layers: dict[int, _Layer] = {}
    for ln in links:
        s_out[id(ln.p)] = ln.scale
        s_in[id(ln.c)] = ln.scale
        layers[id(ln.p)], layers[id(ln.c)] = ln.p, ln.c
    for key, layer in layers.items():
        before[key] = _grid_use(layer.w)
        w = layer.w
        if key in s_in:  # input channel i: axis 1, or axis 0 for a depthwise kernel
            lead = (-1,) if layer.kind is _LayerKind.DEPTHWISE else (1, -1)
            w = w * s_in[key].reshape(lead + (1,) * (w.ndim - len(lead)))
        if key in s_out:
            w = w / s_out[key].reshape((-1,) + (1,) * (w.ndim - 1))
            layer.b = layer.b / s_out[key]
        layer.w = w
    return layers, before


def _link_reports(links: list[_Link]) -> tuple[LinkReport, ...]:
    """The report of each link after equalization and bias absorption."""
    reports = []
    for ln in links:
        reports.append(LinkReport(
            ln.p.node.name, ln.c.node.name, ln.act.value, int(ln.scale.size), float(ln.scale.min()),
            float(ln.scale.max()), int(np.count_nonzero((ln.lower == 1.0) & (ln.upper == 1.0))), ln.proven,
            int(np.count_nonzero((ln.lower > 0) & (ln.lower < 1.0) & np.isclose(ln.scale, ln.lower, rtol=1e-9))),
            int(np.count_nonzero(ln.absorbed)) if ln.absorbed is not None else 0, ln.absorb_note))
    return tuple(reports)


def _layer_ranges(layers: dict[int, _Layer], before: dict[int, tuple[float, float]]) -> tuple[LayerRange, ...]:
    """Each layer's weight grid use and range, before and after the pass."""
    ranges = []
    for key, layer in layers.items():
        use, big = _grid_use(layer.w)
        ranges.append(LayerRange(layer.node.name, before[key][0], use, before[key][1], big))
    return tuple(ranges)


def _stats_for(stats: Mapping[str, ChannelStats], ln: _Link) -> ChannelStats | None:
    st = stats.get(ln.tensor)
    if st is None:
        return None
    lo, hi = np.asarray(st.lo, np.float64).ravel(), np.asarray(st.hi, np.float64).ravel()
    if lo.size != ln.p.out_channels or hi.size != ln.p.out_channels:
        raise MaceqError(f"equalize: channel_stats['{ln.tensor}'] has {lo.size}/{hi.size} channels, "
                         f"node '{ln.p.node.name}' has {ln.p.out_channels}")
    return ChannelStats(lo, hi)


def _absorb(ln: _Link, bound_stats: Mapping[str, ChannelStats], mid_stats: Mapping[str, ChannelStats], *,
            headroom: float, absorb_padded: bool) -> None:
    """Move c (a lower bound of P's scaled pre-activation) from P's bias into C's.

    ``bound_stats``: statistics that may tighten the lower bound (calibrated / replace modes);
    ``mid_stats``: statistics for the midpoint of a linear link (exact for every input)."""
    if ln.padded and not absorb_padded:
        ln.absorb_note = "consumer zero-pads its input"
        return
    if ln.act is ActKind.LINEAR:
        st = _stats_for(mid_stats, ln)
        if st is None:
            ln.absorb_note = "no channel_stats"
            return
        c = (st.lo + st.hi) / 2.0 / ln.scale
    else:
        low = ln.pre_lo
        st = _stats_for(bound_stats, ln)
        if st is not None:
            low = np.maximum(low, st.lo - (headroom - 1.0) * (st.hi - st.lo))
        c = np.maximum(low, 0.0) / ln.scale
        if ln.act is ActKind.BOUNDED:
            c = np.where(ln.free, c, 0.0)  # only channels that never reach the clip
    ln.absorbed = c
    if not np.any(c):
        return
    ln.p.b = ln.p.b - c
    w = ln.c.w
    if ln.c.kind is _LayerKind.DEPTHWISE:
        ln.c.b = ln.c.b + w.reshape(w.shape[0], -1).sum(axis=1) * c
    else:
        ln.c.b = ln.c.b + w.reshape(w.shape[0], w.shape[1], -1).sum(axis=2) @ c


def _store(g: Graph, layer: _Layer) -> None:
    node = layer.node
    w = layer.w
    if node.op_type == "Gemm" and not node.attr("transB", 0):
        w = w.T
    refs = sum(i == node.inputs[1] for n in g.nodes for i in n.inputs)
    name = node.inputs[1] if refs == 1 else _fresh(g, node.inputs[1] + "__cle")
    g.initializers[name] = w.astype(np.float32)
    node.inputs[1] = name
    had_bias = len(node.inputs) > 2 and node.inputs[2]
    if not had_bias and not np.any(layer.b):
        return
    bname = node.inputs[2] if had_bias else ""
    if not had_bias or sum(i == bname for n in g.nodes for i in n.inputs) != 1:
        bname = _fresh(g, (bname or node.name) + "__cle_bias")
    old = g.initializers.get(node.inputs[2]) if had_bias else None
    shape = np.shape(old) if old is not None else (layer.b.size,)
    g.initializers[bname] = layer.b.reshape(shape).astype(np.float32)
    node.inputs = list(node.inputs[:2]) + [bname] + list(node.inputs[3:])


def _fresh(g: Graph, base: str) -> str:
    name, k = base, 1
    while name in g.initializers:
        k += 1
        name = f"{base}{k}"
    return name


# -- statistics --------------------------------------------------------------------------------


def preactivation_name(node: Node) -> str:
    """The tensor that holds ``node``'s pre-activation in :meth:`Graph.to_onnx`'s export."""
    return node.outputs[0] + PREACT_SUFFIX if node.attrs.get(ACT_ATTR) is not None else node.outputs[0]


def collect_channel_stats(graph: Graph, batches: Iterable[Any], *, input_name: str | None = None
                          ) -> dict[str, ChannelStats]:
    """Per-channel min/max of every Conv/Gemm pre-activation (before its fused clamp), keyed by the
    node's output tensor, over ``batches`` (Batch objects, dicts or arrays, as calibrate.runner.collect)."""
    nodes = [n for n in graph.nodes if n.op_type in ("Conv", "Gemm")]
    fetch = [preactivation_name(n) for n in nodes]
    if not fetch:
        return {}
    sess = make_session(expose_outputs(graph.to_onnx(), fetch).SerializeToString())
    if input_name is None:
        if len(graph.inputs) != 1:
            raise MaceqError(f"graph has {len(graph.inputs)} inputs; name the one to feed")
        input_name = graph.inputs[0].name
    runner = BatchedSession(sess, input_name)  # a model whose input fixes its batch takes any batch
    out: dict[str, ChannelStats] = {}
    for item in batches:
        arrays = runner.run(fetch, _feed(item, input_name))
        for node, a in zip(nodes, arrays):
            axes = (0,) + tuple(range(2, a.ndim))
            st = ChannelStats(a.min(axis=axes).astype(np.float64), a.max(axis=axes).astype(np.float64))
            prev = out.get(node.outputs[0])
            out[node.outputs[0]] = st if prev is None else prev.merged(st)
    if not out:
        raise MaceqError("collect_channel_stats: no batch")
    return out
