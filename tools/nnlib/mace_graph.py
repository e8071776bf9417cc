#!/usr/bin/env python3
"""Run a maceq ``dsp`` model on XiaoMi/nnlib (under QEMU) as MACE's DSP runtime builds it.

A maceq dsp model (.yml/.pb) holds MACE-level uint8 ops. MACE's Hexagon converter
(tools/python/transform/hexagon_converter.py) and runtime (mace/runtimes/hexagon/dsp/
hexagon_dsp_wrapper.cc) turn them into one hexagon_nn graph; this module builds that graph:

- node ids: const tensors first, then ops, + 10000 (``kNodeIdOffset``);
- ``QuantizeINPUT_f_to_8`` (no inputs) is the input node: per model input 3 outputs (u8, min,
  max), fed with 4 execute inputs (float NHWC data, min 0, max 0, needs_quantization 1);
- ``DequantizeOUTPUT_8tof`` is the output node: inputs (x, x_min, x_max) per model output, and
  4 execute outputs per output (float data, min, max, flag);
- Conv2D -> ``Supernode_8x8p32to8`` (x, w HWIO, x min/max, w min/max, strides [1,sh,sw,1]
  without data, bias, bias min/max, out min/max), DepthwiseConv2d -> ``DepthwiseSupernode_
  8x8p32to8`` (same, w [KH,KW,C,M]), FullyConnected -> ``SuperFC_8x8p32to8`` (w [H,W,C,O]),
  Eltwise SUM/SUB -> ``QuantizedAdd/Sub_8p8to8`` (a, b, a/b min/max, out min/max), Concat ->
  ``QuantizedConcat_8`` (dim, inputs, mins, maxes), Pooling -> ``QuantizedMax/AvgPool_8`` (x,
  min, max, window and strides [1,h,w,1] without data), Reduce (mean) -> ``QuantizedMean_8``
  (x, min, max, axes, out min/max);
- an activation's min/max are ports 1 and 2 of its producer; a const's min/max and an op's
  output range are float32 scalar const nodes (the tensor's minval/maxval);
- padding (ONNX models: no ``padding`` argument): VALID when the output size is
  ``(in-k)//s+1``, else SAME_CAFFE when it is ``(in-1)//s+1``, else MACE fails. Explicit pads are
  not looked at (``Mapping(padding="maceq")`` uses maceq's ``padding_for_pads`` instead).

Ops maceq places on the cpu (fallback) cannot run in MACE's DSP graph. Such models are run in
segments: each maximal run of dsp ops is one nnlib graph (its inputs enter through
QuantizeINPUT_f_to_8 with needs_quantization 0, i.e. u8 codes plus min/max; all its tensors
leave through an OUTPUT node), the other ops run in maceq's dsp simulation in between;
``NnlibRun.fully_on_nnlib`` says which case it was.

As a module (tools/ is not a package)::

    sys.path.insert(0, "tools/nnlib"); import mace_graph as M
    r = M.run_model(load("m.yml"), {"input": x_nchw}, intermediates=True)
    r.outputs["logits"]; r.tensors["/features/..._output_0"]  # (u8 NHWC codes, min, max)
    ok, detail = M.accepts(M.OpConfig("DepthwiseConv2d", kernel=(3, 3), strides=(3, 3)))

CLI: ``python3 tools/nnlib/mace_graph.py MODEL.yml [--image IMG] [--intermediates] [--compare]``,
``python3 tools/nnlib/mace_graph.py --accept`` (nnlib's acceptance vs maceq's placement rules).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as N  # noqa: E402

NODE_ID_OFFSET = 10000  # hexagon_control_wrapper.h kNodeIdOffset
PAD = {"NA": 0, "SAME": 1, "VALID": 2, "SAME_CAFFE": 5}
MACE_PADDING_ARG = {0: PAD["VALID"], 1: PAD["SAME"], 4: PAD["NA"]}  # base_converter.PaddingMode -> hexagon
INPUT_NODE, OUTPUT_NODE = "mace_input_node", "mace_output_node"
_F1 = (4, (1, 1, 1, 1))


class NnlibError(N.NnlibError):
    def __init__(self, msg, op=None):
        super().__init__(msg)
        self.op = op  # the MACE op nnlib failed on, when the log names its node


@dataclass(frozen=True)
class Mapping:
    """How MACE ops become nnlib ops. Default: as MACE does; the alternatives are maceq's choices."""

    reduce: str = "QuantizedMean_8"  # MACE; "QuantizedAvgPool_8" = maceq's ops_dsp.DspReduce
    padding: str = "mace"  # MACE's output-size rule; "maceq" = kernels.dsp.padding_for_pads


MACE = Mapping()
MACEQ = Mapping(reduce="QuantizedAvgPool_8", padding="maceq")


def _shape4(shape) -> tuple:
    shape = tuple(int(s) for s in shape)
    if len(shape) > 4:
        raise NnlibError(f"rank {len(shape)} > 4: {shape}")
    return (1,) * (4 - len(shape)) + shape


@dataclass
class HexOp:
    name: str
    type: str
    inputs: list  # (node name, port)
    outputs: list  # (element size, shape4)
    padding: int = 0


@dataclass
class HexNet:
    """One hexagon_nn graph in MACE's terms: named consts and ops, numbered when written."""

    consts: dict = field(default_factory=dict)  # name -> (shape4, bytes | None)
    ops: list = field(default_factory=list)
    ports: dict = field(default_factory=dict)  # MACE tensor -> (node name, port)
    mm: dict = field(default_factory=dict)  # MACE tensor -> [min ref, max ref] where not ports + 1, + 2
    feeds: list = field(default_factory=list)  # (element size, shape4, bytes)
    outs: list = field(default_factory=list)  # ("output", (node, port), maxbytes) | ("outbuf", maxbytes, bytes|None)
    sources: dict = field(default_factory=dict)  # hex op name -> MACE op name

    def const(self, name, arr=None, shape=None) -> tuple:
        if name not in self.consts:
            data = None if arr is None else np.ascontiguousarray(arr).tobytes()
            self.consts[name] = (_shape4(shape if shape is not None else np.shape(arr)), data)
        return (name, 0)

    def scalar(self, name, v) -> tuple:
        return self.const(name, np.array([v], np.float32), (1,))

    def add(self, op: HexOp, mace_op=None):
        self.ops.append(op)
        self.sources[op.name] = mace_op or op.name

    def spec(self) -> tuple:
        """(run.Graph holding the harness spec and files, {name: node id})."""
        g, ids = N.Graph(), {}
        for i, name in enumerate(list(self.consts) + [op.name for op in self.ops]):
            ids[name] = NODE_ID_OFFSET + i
        for name, (shape, data) in self.consts.items():
            g.lines.append(f"const {ids[name]} {' '.join(map(str, shape))} {'-' if data is None else g._file(data)}")
        for es, shape, data in self.feeds:
            g.lines.append(f"feed {es} {' '.join(map(str, shape))} {g._file(data)}")
        for op in self.ops:
            refs = " ".join(f"{ids[n]}:{p}" for n, p in op.inputs)
            outs = " ".join(f"{es}:{':'.join(map(str, sh))}" for es, sh in op.outputs)
            g.lines.append(f"node {ids[op.name]} {op.type} {op.padding} {len(op.inputs)} {refs} "
                           f"{len(op.outputs)} {outs}")
        for o in self.outs:
            if o[0] == "output":
                g.lines.append(f"output {ids[o[1][0]]}:{o[1][1]} {o[2]}")
            else:
                g.lines.append(f"outbuf {o[1]}" + ("" if o[2] is None else f" {g._file(o[2])}"))
        return g, ids


@dataclass
class Ctx:
    """What the converter reads: constants (maceq layouts), their QInfo, every tensor's shape."""

    consts: dict
    const_qinfo: dict
    shapes: dict
    mapping: Mapping = MACE


# ----------------------------------------------------------------------------------------------
# MACE op -> hexagon_nn op (hexagon_converter.py)
# ----------------------------------------------------------------------------------------------

def _ref(net: HexNet, ctx: Ctx, t: str) -> tuple:
    if t in net.ports:
        return net.ports[t]
    if t in ctx.consts:
        return net.const(t, ctx.consts[t])
    raise NnlibError(f"tensor '{t}' has no producer in this graph")


def _minmax(net: HexNet, ctx: Ctx, t: str) -> list:
    """add_min_max_const_node: ports 1, 2 of an activation's producer; scalar consts for a const."""
    if t in net.mm:
        return list(net.mm[t])
    if t in net.ports:
        node, port = net.ports[t]
        return [(node, port + 1), (node, port + 2)]
    if t in ctx.consts:
        q = ctx.const_qinfo[t]
        return [net.scalar(t + "_min", q.minval), net.scalar(t + "_max", q.maxval)]
    raise NnlibError(f"quantize info not found: '{t}'")


def _out_minmax(net: HexNet, op) -> list:
    if not op.out_qinfo:
        raise NnlibError(f"op '{op.name}': no quantize_info for its output")
    q = op.out_qinfo[0]
    return [net.scalar(op.outputs[0] + "_min", q.minval), net.scalar(op.outputs[0] + "_max", q.maxval)]


def _emit(net: HexNet, op, hex_type: str, inputs: list, padding: int = 0):
    """Append the node for MACE op ``op``: outputs (u8 out shape, min, max), port 0 = op.outputs[0]."""
    net.add(HexOp(op.name, hex_type, inputs, [(1, _shape4(op.output_shapes[0])), _F1, _F1], padding), op.name)
    net.ports[op.outputs[0]] = (op.name, 0)


def _pads(op) -> tuple:
    ph, pw = op.arg("padding_values", [0, 0])
    return ph >> 1, pw >> 1, ph - (ph >> 1), pw - (pw >> 1)


def _padding(ctx: Ctx, op, kernel, strides) -> int:
    """add_padding_type_for_conv_pooling (or maceq's padding_for_pads with Mapping(padding='maceq'))."""
    if op.arg("padding") is not None:
        if int(op.arg("padding")) not in MACE_PADDING_ARG:
            raise NnlibError(f"op '{op.name}': padding mode {op.arg('padding')} has no hexagon padding")
        return MACE_PADDING_ARG[int(op.arg("padding"))]
    in_h, in_w = ctx.shapes[op.inputs[0]][1:3]
    out_h, out_w = op.output_shapes[0][1:3]
    (kh, kw), (sh, sw) = kernel, strides
    if ctx.mapping.padding == "maceq":
        from maceq.runtime.kernels import dsp as K

        return int(K.padding_for_pads(in_hw=(in_h, in_w), kernel=kernel, strides=strides, pads=_pads(op)))
    if out_h == (in_h - kh) // sh + 1 and out_w == (in_w - kw) // sw + 1:
        return PAD["VALID"]
    if out_h == (in_h - 1) // sh + 1 and out_w == (in_w - 1) // sw + 1:
        return PAD["SAME_CAFFE"]
    raise NnlibError(f"op '{op.name}': Hexagon does not support padding type for input {in_h}x{in_w}, output "
                     f"{out_h}x{out_w}, kernel {kh}x{kw}, strides {sh}x{sw} (MACE's converter fails)")


def _bias(net: HexNet, ctx: Ctx, op, n_out: int) -> tuple:
    """The bias input (MACE's add_bias: zeros with min = max = 0 when the op has none)."""
    if len(op.inputs) >= 3:
        b = op.inputs[2]
        return net.const(b, np.asarray(ctx.consts[b], np.int32).reshape(-1)), _minmax(net, ctx, b)
    name = op.name + "/bias"
    ref = net.const(name, np.zeros(n_out, np.int32))
    return ref, [net.scalar(name + "_min", 0.0), net.scalar(name + "_max", 0.0)]


def _conv(net: HexNet, ctx: Ctx, op):
    from maceq.runtime.kernels import dsp as K

    dw = op.type == "DepthwiseConv2d"
    if tuple(op.arg("dilations", [1, 1])) != (1, 1):
        raise NnlibError(f"op '{op.name}': Hexagon only support dilations[1,1] (MACE's converter fails)")
    x, wn = op.inputs[0], op.inputs[1]
    w = np.asarray(ctx.consts[wn]) if dw else K.ohwi_to_hwio(ctx.consts[wn])
    strides = tuple(int(s) for s in op.arg("strides", [1, 1]))
    bias, bias_mm = _bias(net, ctx, op, w.shape[2] * w.shape[3] if dw else w.shape[3])
    inputs = [_ref(net, ctx, x), net.const(wn, w)] + _minmax(net, ctx, x) + _minmax(net, ctx, wn)
    inputs += [net.const(op.name + "/strides", None, (1, *strides, 1)), bias] + bias_mm + _out_minmax(net, op)
    pad = _padding(ctx, op, w.shape[:2], strides)
    _emit(net, op, "DepthwiseSupernode_8x8p32to8" if dw else "Supernode_8x8p32to8", inputs, pad)


def _fc(net: HexNet, ctx: Ctx, op):
    from maceq.runtime.kernels import dsp as K

    x, wn = op.inputs[0], op.inputs[1]
    w = np.asarray(ctx.consts[wn])
    w = K.ohwi_to_hwio(w.reshape(w.shape[0], 1, 1, -1) if w.ndim == 2 else w)
    bias, bias_mm = _bias(net, ctx, op, w.shape[3])
    inputs = [_ref(net, ctx, x), net.const(wn, w)] + _minmax(net, ctx, x) + _minmax(net, ctx, wn)
    _emit(net, op, "SuperFC_8x8p32to8", inputs + [bias] + bias_mm + _out_minmax(net, op))


def _eltwise(net: HexNet, ctx: Ctx, op):
    kind = int(op.arg("type", 0))
    if kind not in (0, 1) or len(op.inputs) != 2:
        raise NnlibError(f"op '{op.name}': only two-input Eltwise SUM/SUB are mapped (type {kind})")
    a, b = op.inputs
    inputs = [_ref(net, ctx, a), _ref(net, ctx, b)] + _minmax(net, ctx, a) + _minmax(net, ctx, b)
    _emit(net, op, "QuantizedSub_8p8to8" if kind == 1 else "QuantizedAdd_8p8to8", inputs + _out_minmax(net, op))


def _concat(net: HexNet, ctx: Ctx, op):
    dim = net.const(op.name + "/dim", np.array([int(op.arg("axis", 3))], np.int32))
    mms = [_minmax(net, ctx, t) for t in op.inputs]
    inputs = [dim] + [_ref(net, ctx, t) for t in op.inputs] + [m[0] for m in mms] + [m[1] for m in mms]
    _emit(net, op, "QuantizedConcat_8", inputs)


def _pool(net: HexNet, ctx: Ctx, op):
    kernel = tuple(int(k) for k in op.require("kernels"))
    strides = tuple(int(s) for s in op.arg("strides", [1, 1]))
    x = op.inputs[0]
    inputs = [_ref(net, ctx, x)] + _minmax(net, ctx, x)
    inputs += [net.const(op.name + "/window", None, (1, *kernel, 1)), net.const(op.name + "/strides", None,
                                                                               (1, *strides, 1))]
    hex_type = "QuantizedMaxPool_8" if int(op.require("pooling_type")) == 2 else "QuantizedAvgPool_8"
    _emit(net, op, hex_type, inputs, _padding(ctx, op, kernel, strides))


def _reduce(net: HexNet, ctx: Ctx, op):
    if int(op.arg("reduce_type", 0)) != 0 or int(op.arg("keepdims", 1)) != 1:
        raise NnlibError(f"op '{op.name}': Hexagon Reduce only supports Mean with keep dims")
    x = op.inputs[0]
    inputs = [_ref(net, ctx, x)] + _minmax(net, ctx, x)
    if ctx.mapping.reduce == "QuantizedAvgPool_8":  # maceq's mapping: the whole plane, VALID
        h, w = ctx.shapes[x][1:3]
        inputs += [net.const(op.name + "/window", None, (1, h, w, 1)), net.const(op.name + "/strides", None,
                                                                                (1, 1, 1, 1))]
        return _emit(net, op, "QuantizedAvgPool_8", inputs, PAD["VALID"])
    axes = net.const(op.name + "/axes", np.asarray(op.arg("axis", [1, 2]), np.int32))
    _emit(net, op, "QuantizedMean_8", inputs + [axes] + _out_minmax(net, op))


CONVERTERS = {"Conv2D": _conv, "DepthwiseConv2d": _conv, "FullyConnected": _fc, "Eltwise": _eltwise,
              "Concat": _concat, "Pooling": _pool, "Reduce": _reduce}


# ----------------------------------------------------------------------------------------------
# Graph assembly: input node, ops, output node or taps
# ----------------------------------------------------------------------------------------------

@dataclass
class Feed:
    """One graph input: a model float input (through the input Quantize) or u8 codes with a range."""

    tensor: str  # the MACE tensor the input node's port 3i holds
    data: np.ndarray  # float32 NHWC (needs_quantization 1) or uint8 NHWC (0)
    min: float = 0.0
    max: float = 0.0

    @property
    def quantize(self) -> bool:
        return self.data.dtype != np.uint8


def _input_node(net: HexNet, feeds: list):
    """QuantizeINPUT_f_to_8 with no inputs; 4 execute inputs per feed (hexagon_dsp_wrapper.cc)."""
    outs = []
    for i, f in enumerate(feeds):
        data = np.ascontiguousarray(f.data, np.float32 if f.quantize else np.uint8)
        shape = _shape4(data.shape)
        net.feeds += [(data.itemsize, shape, data.tobytes()), (4, (1, 1, 1, 1), np.float32(f.min).tobytes()),
                      (4, (1, 1, 1, 1), np.float32(f.max).tobytes()),
                      (4, (1, 1, 1, 1), np.int32(1 if f.quantize else 0).tobytes())]
        outs += [(1, shape), _F1, _F1]
        net.ports[f.tensor] = (INPUT_NODE, 3 * i)
    net.add(HexOp(INPUT_NODE, "QuantizeINPUT_f_to_8", [], outs), "Quantize")


def _output_node(net: HexNet, ctx: Ctx, tensors: list):
    """DequantizeOUTPUT_8tof: (x, min, max) per output; 4 execute outputs each (data, min, max, flag)."""
    inputs = []
    for t in tensors:
        inputs += [_ref(net, ctx, t)] + _minmax(net, ctx, t)
        n = math.prod(ctx.shapes[t])
        net.outs += [("outbuf", 4 * n, None), ("outbuf", 4, None), ("outbuf", 4, None),
                     ("outbuf", 4, np.int32(1).tobytes())]
    net.add(HexOp(OUTPUT_NODE, "DequantizeOUTPUT_8tof", inputs, []), "Dequantize")


def _taps(net: HexNet, ctx: Ctx, tensors: list):
    """An OUTPUT node over ports 0, 1, 2 (u8 data, min, max) of every tensor in ``tensors``."""
    for t in tensors:
        mn, mx = _minmax(net, ctx, t)
        net.outs += [("output", net.ports[t], math.prod(ctx.shapes[t])), ("output", mn, 4), ("output", mx, 4)]


def _via_d32(net: HexNet, feeds: list):
    """Convert_to_d32 -> Convert_from_d32 on each fed tensor: its consumers then see a d32 producer,
    as inside a model (nnlib's prepare then picks the _d32 variants). Not part of MACE's graph."""
    for f in feeds:
        shape = _shape4(f.data.shape)
        node, port = net.ports[f.tensor]
        net.mm[f.tensor] = [(node, port + 1), (node, port + 2)]
        net.add(HexOp(f.tensor + "/to_d32", "Convert_to_d32", [(node, port)], [(1, shape)]))
        net.add(HexOp(f.tensor + "/from_d32", "Convert_from_d32", [(f.tensor + "/to_d32", 0)], [(1, shape)]))
        net.ports[f.tensor] = (f.tensor + "/from_d32", 0)


def build_net(ctx: Ctx, ops: list, feeds: list, *, outputs=None, taps=None, d32=False) -> HexNet:
    """The graph for ``ops`` (MACE ops; Quantize/Dequantize skipped: the feeds and outputs stand for them).

    outputs: tensors dequantized by DequantizeOUTPUT_8tof (MACE's graph); taps: tensors whose u8
    data and min/max leave through an OUTPUT node (the two cannot be combined in one graph).
    d32: pass the fed tensors through Convert_to_d32/Convert_from_d32 first (single-op sweeps).
    """
    if outputs and taps:
        raise NnlibError("DequantizeOUTPUT_8tof and OUTPUT cannot share a graph: pass outputs or taps")
    net = HexNet()
    _input_node(net, feeds)
    if d32:
        _via_d32(net, feeds)
    for op in ops:
        if op.type in ("Quantize", "Dequantize"):
            continue
        if op.type not in CONVERTERS:
            raise NnlibError(f"op '{op.name}' ({op.type}): no hexagon_nn mapping (MACE's converter would fail)")
        CONVERTERS[op.type](net, ctx, op)
    if outputs:
        _output_node(net, ctx, outputs)
    if taps:
        _taps(net, ctx, taps)
    return net


def run_net(net: HexNet, **kw) -> N.Result:
    """Write, prepare and execute the graph; NnlibError (with .op when nnlib names the node) on failure."""
    g, ids = net.spec()
    try:
        res = N.run_graph(g, **kw)
    except N.NnlibError as e:
        if "unknown keyword 'outbuf'" in str(e) or "need an 'input' line" in str(e):
            raise NnlibError("the harness predates outbuf/feeds without INPUT: rebuild it with tools/nnlib/setup.sh") \
                from None
        raise
    if res.prepared and (kw.get("prepare_only") or res.executed):
        return res
    what = "prepare" if not res.prepared else "execute"
    log = res.log.strip() or res.stdout.strip()
    m = re.search(r"failed on node id=([0-9a-f]+)", log)  # execute.c prints it in hex
    by_id = {v: k for k, v in ids.items()}
    node = by_id.get(int(m.group(1), 16)) if m else None
    lines = [ln.split(":", 2)[-1] for ln in log.splitlines() if "execute.c" not in ln and "interface.c" not in ln]
    where = f" on {net.sources.get(node, node)}" if node else ""
    raise NnlibError(f"nnlib {what} failed{where} (rc {res.returncode}): {' | '.join(lines[-2:])[-400:]}",
                     op=net.sources.get(node) if node else None)


# ----------------------------------------------------------------------------------------------
# Whole models: MACE's graph when every op is on the dsp, else segments
# ----------------------------------------------------------------------------------------------

def model_ctx(model, mapping: Mapping = MACE) -> Ctx:
    shapes = {i.name: tuple(int(d) for d in i.dims) for i in model.net_def.input_info}
    shapes.update({n: tuple(a.shape) for n, a in model.consts.items()})
    for op in model.ops:
        shapes.update(zip(op.outputs, (tuple(s) for s in op.output_shapes)))
    return Ctx(model.consts, model.const_qinfo, shapes, mapping)


def mappable(op) -> bool:
    """An op this module can put into the nnlib graph (MACE's converter has a rule for it)."""
    if op.type not in CONVERTERS or op.arg("T", 2) == 1:
        return False
    if op.type == "Eltwise":
        return int(op.arg("type", 0)) in (0, 1) and len(op.inputs) == 2
    if op.type == "Reduce":
        return int(op.arg("reduce_type", 0)) == 0 and int(op.arg("keepdims", 1)) == 1
    return True


def maceq_placement(model) -> dict:
    """maceq's placement on dsp {op: (where, why)}: Model.placement, or, when maceq's simulation of the
    probe input fails, each op's prepare alone (inputs quantized as their producers declare)."""
    from maceq.errors import MaceqError

    try:
        return model.placement("dsp")
    except MaceqError:
        pass
    from maceq.runtime.registry import op_dtype, table_placement

    ctx = model.context("dsp")
    q = dict(model.const_qinfo)
    out = {}
    for op in model.ops:
        q.update(zip(op.outputs, op.out_qinfo))
        try:
            where = model.prepare(op, tuple(q.get(i) for i in op.inputs), ctx).placement
        except Exception:  # noqa: BLE001 - not prepared: placed by the kernel table alone
            where = table_placement(op.type, op_dtype(op), ctx.spec.device)
        out[op.name] = (where.device.value, where.reason)
    return out


@dataclass
class Plan:
    fully_on_nnlib: bool
    items: list  # a list of ops = one nnlib graph; an op alone = runs in maceq's dsp simulation
    cpu_ops: list  # (op name, type, why it is not on nnlib)


def plan(model, placement=None, rejected=None) -> Plan:
    """Split the model's ops into nnlib graphs and ops left to maceq (cpu fallback, float, boundaries).

    placement: model.placement("dsp") (computed when None); rejected: {op name: why} ops to leave to
    maceq although maceq places them on the dsp (nnlib failed on them).
    """
    placement = placement or maceq_placement(model)
    rejected = rejected or {}
    ins, outs = set(model.input_names), set(model.output_names)
    in_q = {op.name for op in model.ops if op.type == "Quantize" and op.inputs[0] in ins}
    out_dq = {op.name for op in model.ops if op.type == "Dequantize" and op.outputs[0] in outs}

    def on_nnlib(op):
        if op.type in ("Quantize", "Dequantize"):
            return op.name in in_q
        return placement[op.name][0] == "dsp" and mappable(op) and op.name not in rejected

    def why(op):
        if op.type in ("Quantize", "Dequantize"):
            return "float boundary inside the graph (MACE's DSP graph has none)"
        return rejected.get(op.name) or placement[op.name][1] or ("float op" if op.arg("T") == 1 else
                                                                  "no nnlib mapping")

    cpu = [(op.name, op.type, why(op))
           for op in model.ops if not on_nnlib(op) and op.name not in out_dq and op.name not in in_q]
    if not cpu and len(in_q) == len(ins) and len(out_dq) == len(outs):
        return Plan(True, [list(model.ops)], [])
    items, cur = [], []
    for op in model.ops:
        if on_nnlib(op):
            cur.append(op)
            continue
        if cur:
            items.append(cur)
            cur = []
        items.append(op)
    if cur:
        items.append(cur)
    return Plan(False, items, cpu)


@dataclass
class SegmentRun:
    ops: list  # MACE op names in this nnlib graph
    feeds: list  # (tensor, "float" | "u8")
    nodes: list  # nnlib's nodes after prepare: (node id, op type)
    hex_ops: list  # (hexagon op name = MACE op name, hexagon op type) as built
    wall_s: float


@dataclass
class NnlibRun:
    outputs: dict  # model output -> float32, in the layout maceq's Model.run returns
    tensors: dict  # MACE tensor -> (u8 codes NHWC, min, max): from nnlib (see source)
    source: dict  # MACE tensor -> "nnlib" | "maceq"
    segments: list  # SegmentRun per nnlib graph
    fully_on_nnlib: bool
    cpu_ops: list = field(default_factory=list)  # (op, type, why) run in maceq's dsp simulation
    notes: list = field(default_factory=list)
    rejected: dict = field(default_factory=dict)  # op -> nnlib's error, for ops maceq places on the dsp


def float_inputs(model, inputs: dict) -> dict:
    """The caller's float inputs (maceq's layout, NCHW for 4-D) as MACE feeds them: NHWC float32."""
    xs = {}
    for name in model.input_names:
        if name not in inputs:
            raise NnlibError(f"missing input '{name}' (model inputs: {', '.join(model.input_names)})")
        x = np.asarray(inputs[name], np.float32)
        if x.ndim == 4 and model.input_formats[name] == "NCHW":
            x = x.transpose(0, 2, 3, 1)
        xs[name] = np.ascontiguousarray(x)
    return xs


def caller_layout(model, name: str, y: np.ndarray) -> np.ndarray:
    """A model output as maceq's Model.run returns it (NCHW for 4-D NCHW outputs, else reshaped)."""
    info = model.output_info[name]
    if len(info.dims) == 4:
        y = y.reshape(_shape4(y.shape))
        return np.ascontiguousarray(y.transpose(0, 3, 1, 2) if info.data_format == 1 else y, np.float32)
    return np.ascontiguousarray(y.reshape((y.shape[0] if y.ndim else 1,) + tuple(int(d) for d in info.dims[1:])),
                                np.float32)


def _read_taps(res: N.Result, tensors: list, ctx: Ctx) -> dict:
    out = {}
    for i, t in enumerate(tensors):
        codes = np.frombuffer(res.outputs[3 * i], np.uint8)
        if codes.size != math.prod(ctx.shapes[t]):
            raise NnlibError(f"tensor '{t}': nnlib gave {codes.size} values for shape {ctx.shapes[t]}")
        out[t] = (codes.reshape(ctx.shapes[t]).copy(), res.scalar(3 * i + 1), res.scalar(3 * i + 2))
    return out


def _segment_record(net: HexNet, res: N.Result, ops, feeds, wall) -> SegmentRun:
    hex_ops = [(op.name, op.type) for op in net.ops]
    return SegmentRun([op.name for op in ops], [(f.tensor, "float" if f.quantize else "u8") for f in feeds],
                      list(res.nodes), hex_ops, wall)


def _run_full(model, ctx: Ctx, ops: list, xs: dict, intermediates: bool, kw) -> NnlibRun:
    by_in = {op.inputs[0]: op for op in ops if op.type == "Quantize" and op.inputs[0] in xs}
    by_out = {op.outputs[0]: op for op in ops if op.type == "Dequantize"}
    feeds = [Feed(by_in[n].outputs[0], xs[n]) for n in model.input_names]
    finals = [by_out[n].inputs[0] for n in model.output_names]
    t0 = time.perf_counter()
    net = build_net(ctx, ops, feeds, outputs=finals)
    res = run_net(net, **kw)
    seg = _segment_record(net, res, ops, feeds, time.perf_counter() - t0)
    outputs = {n: caller_layout(model, n, res.array(4 * i, np.float32)) for i, n in enumerate(model.output_names)}
    run = NnlibRun(outputs, {}, {}, [seg], True)
    if not by_in or any(int(op.arg("find_range_every_time", 1)) == 0 for op in by_in.values()):
        run.notes.append("an input Quantize has find_range_every_time=0: MACE's QuantizeINPUT_f_to_8 still "
                         "finds the range of each input")
    if intermediates:
        taps = [f.tensor for f in feeds] + [op.outputs[0] for op in ops if op.type not in ("Quantize", "Dequantize")]
        res2 = run_net(build_net(ctx, ops, feeds, taps=taps), **kw)
        run.tensors = _read_taps(res2, taps, ctx)
        run.source = {t: "nnlib" for t in taps}
        _check_taps_agree(res, run.tensors, finals)
    return run


def _check_taps_agree(res: N.Result, tensors: dict, finals: list):
    """The tap graph must give the final tensors MACE's graph dequantized (same range, one float per code)."""
    for i, t in enumerate(finals):
        codes, mn, mx = tensors[t]
        if (np.float32(mn), np.float32(mx)) != (np.float32(res.scalar(4 * i + 1)), np.float32(res.scalar(4 * i + 2))):
            raise NnlibError(f"tensor '{t}': the tap graph's range differs from the DequantizeOUTPUT graph's")
        f = res.array(4 * i, np.float32).reshape(-1)
        pairs = np.unique(np.stack([codes.reshape(-1).astype(np.float64), f.astype(np.float64)]), axis=1)
        if len(np.unique(pairs[0])) != pairs.shape[1]:
            raise NnlibError(f"tensor '{t}': the tap graph's codes do not match the DequantizeOUTPUT graph's floats")


def _segment_feeds(seg: list, values: dict, tensors: dict, xs: dict, consts: dict) -> list:
    from maceq.runtime.ops_dsp import rng

    made = {t for op in seg for t in op.outputs}
    feeds, seen = [], set()
    for op in seg:
        for t in op.inputs:
            if t in made or t in consts or t in seen:
                continue
            seen.add(t)
            if op.type == "Quantize":
                feeds.append(Feed(op.outputs[0], xs[t]))
            elif t in tensors:  # made by an earlier nnlib graph: its exact range
                feeds.append(Feed(t, tensors[t][0], tensors[t][1], tensors[t][2]))
            else:
                q = values[t]
                if q.qinfo is None:
                    raise NnlibError(f"tensor '{t}' is float but op '{op.name}' runs on nnlib")
                feeds.append(Feed(t, np.asarray(q.values, np.uint8), *rng(q.qinfo)))
    return feeds


def _maceq_op(model, op, ins, p: Plan, run: NnlibRun) -> list:
    """An op left to maceq: its dsp simulation; for an op nnlib rejected that maceq's dsp kernel
    cannot run either, the cpu kernel (what maceq's dsp fallback runs)."""
    from maceq.errors import MaceqError

    try:
        return model.run_op(op, ins, device="dsp")
    except MaceqError as e:
        if not any(c[0] == op.name and c[2].startswith("nnlib ") for c in p.cpu_ops):
            raise
        run.notes.append(f"{op.name}: maceq's dsp kernel fails too ({str(e).splitlines()[0]}); ran its cpu kernel")
        return model.run_op(op, ins, device="cpu")


def _run_split(model, ctx: Ctx, p: Plan, xs: dict, kw) -> NnlibRun:
    from maceq.runtime.model import QTensor
    from maceq.runtime.ops_dsp import qinfo_of_range

    values = {n: QTensor(x, None) for n, x in xs.items()}
    run = NnlibRun({}, {}, {}, [], False, p.cpu_ops)
    for item in p.items:
        if not isinstance(item, list):
            outs = _maceq_op(model, item, [values.get(t) for t in item.inputs], p, run)
            values.update(zip(item.outputs, outs))
            run.source.update({t: "maceq" for t in item.outputs})
            continue
        feeds = _segment_feeds(item, values, run.tensors, xs, ctx.consts)
        taps = [f.tensor for f in feeds if f.quantize] + [op.outputs[0] for op in item if op.type != "Quantize"]
        t0 = time.perf_counter()
        net = build_net(ctx, item, feeds, taps=taps)
        res = run_net(net, **kw)
        run.segments.append(_segment_record(net, res, item, feeds, time.perf_counter() - t0))
        got = _read_taps(res, taps, ctx)
        run.tensors.update({f.tensor: (f.data, f.min, f.max) for f in feeds if not f.quantize and f.tensor not in
                            run.tensors})  # what nnlib was given (made by maceq)
        run.tensors.update(got)
        run.source.update({t: "nnlib" for t in got})
        values.update({t: QTensor(c, qinfo_of_range(mn, mx)) for t, (c, mn, mx) in got.items()})
    for n in model.output_names:
        t = values[n]
        run.outputs[n] = caller_layout(model, n, t.values if t.qinfo is None else t.dequantize())
    return run


def run_model(model, inputs: dict, *, intermediates: bool = False, mapping: Mapping = MACE,
              on_reject: str = "raise", placement=None, **kw) -> NnlibRun:
    """Run a maceq dsp model on nnlib: MACE's graph when every op is on the dsp, else in segments.

    inputs: {name: float array} in maceq's layout (NCHW for 4-D inputs). intermediates: also every
    u8 tensor of MACE's graph (a second graph with an OUTPUT node; checked against the first).
    In segment mode every nnlib tensor comes back anyway. on_reject: "raise" (NnlibError when
    nnlib fails, as MACE would) or "maceq" (run the op nnlib fails on in maceq's simulation and
    record it in ``rejected``). kw: run.run_graph's (harness, qemu, ...).
    """
    if on_reject not in ("raise", "maceq"):
        raise NnlibError(f"on_reject must be 'raise' or 'maceq', not {on_reject!r}")
    ctx = model_ctx(model, mapping)
    xs = float_inputs(model, inputs)
    placement = placement or maceq_placement(model)
    rejected = {}
    while True:
        p = plan(model, placement, rejected)
        try:
            run = _run_full(model, ctx, p.items[0], xs, intermediates, kw) if p.fully_on_nnlib else \
                _run_split(model, ctx, p, xs, kw)
        except NnlibError as e:
            if on_reject == "raise" or e.op is None or e.op in rejected or e.op in ("Quantize", "Dequantize"):
                raise
            rejected[e.op] = str(e)
            continue
        run.rejected = rejected
        return run


# ----------------------------------------------------------------------------------------------
# Single ops: OpConfig -> a MACE op (as maceq writes it) -> nnlib, and acceptance
# ----------------------------------------------------------------------------------------------

OP_KINDS = ("Conv2D", "DepthwiseConv2d", "FullyConnected", "MaxPool", "AvgPool", "Add", "Sub", "Concat", "Mean")


@dataclass(frozen=True)
class OpConfig:
    """One MACE op in maceq's form. Ranges are float (min, max); out_range None = a fixed range
    scaled to the op (as MACE passes quantize_info), (-inf, inf) = open (nnlib finds it)."""

    kind: str  # one of OP_KINDS
    in_shape: tuple = (1, 16, 16, 32)
    kernel: tuple = (3, 3)
    strides: tuple = (1, 1)
    padding_values: tuple = (2, 2)  # MACE's total pad per axis; maceq's pads: top = total // 2
    dilations: tuple = (1, 1)
    out_channels: int = 32  # Conv2D / FullyConnected
    multiplier: int = 1  # DepthwiseConv2d
    axis: int = 3  # Concat
    axes: tuple = (1, 2)  # Mean
    b_shape: tuple | None = None  # 2nd input of Add/Sub/Concat (default in_shape)
    x_range: tuple = (-1.0, 1.0)
    b_range: tuple = (-1.0, 1.0)
    w_range: tuple = (-1.0, 1.0)
    out_range: tuple | None = None
    adjust: bool = True  # ranges made zero-exact as MACE's converter does (adjust_range_for_hexagon)
    bias: bool = True
    d32: bool = False  # inputs via Convert_to_d32/Convert_from_d32 (a d32 producer, as inside a model)
    seed: int = 0

    def label(self) -> str:
        s = f"{self.kind} in{'x'.join(map(str, self.in_shape))}"
        if self.kind in ("Conv2D", "DepthwiseConv2d", "MaxPool", "AvgPool"):
            (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.strides, self.padding_values
            s += f" k{kh}x{kw} s{sh}x{sw} pv{ph},{pw}"
            s += f" d{self.dilations[0]}" if tuple(self.dilations) != (1, 1) else ""
            s += f" m{self.multiplier}" if self.multiplier != 1 else ""
        if self.b_shape is not None:
            s += f" b{'x'.join(map(str, self.b_shape))}"
        s += f" axis{self.axis}" if self.kind == "Concat" else ""
        s += f" axes{''.join(map(str, self.axes))}" if self.kind == "Mean" else ""
        s += " open" if self.out_range is not None and math.isinf(self.out_range[1]) else ""
        return s + (" d32" if self.d32 else "")


@dataclass
class Case:
    """A single-op model: the op, its consts (maceq layouts) and QInfo, the u8 inputs with ranges."""

    cfg: OpConfig
    op: object  # maceq.runtime.graph.RtOp
    consts: dict
    const_qinfo: dict
    inputs: list  # (tensor, u8 NHWC, min, max)
    shapes: dict


def _qinfo(mn, mx):
    from maceq.runtime.qtypes import QInfo

    if not (math.isfinite(mn) and math.isfinite(mx)):
        return QInfo(0.0, 0, float(mn), float(mx))
    from maceq.runtime.ops_dsp import qinfo_of_range

    return qinfo_of_range(float(np.float32(mn)), float(np.float32(mx)))


def _range(cfg: OpConfig, r) -> tuple:
    """A configured range as float32 values, made zero-exact MACE's way when cfg.adjust."""
    mn, mx = float(r[0]), float(r[1])
    if cfg.adjust and math.isfinite(mn) and math.isfinite(mx):
        from maceq.quant import converter as QC

        mn, mx = QC.mace_adjust_range_for_hexagon(mn, mx)[:2]
    return float(np.float32(mn)), float(np.float32(mx))


def _out_hw(cfg: OpConfig):
    out = []
    for i in (1, 2):
        k = (cfg.kernel[i - 1] - 1) * cfg.dilations[i - 1] + 1
        out.append((cfg.in_shape[i] + cfg.padding_values[i - 1] - k) // cfg.strides[i - 1] + 1)
    return tuple(out)


def _default_out_range(cfg: OpConfig, k_taps: int):
    (xa, xb), (ba, bb), (wa, wb) = cfg.x_range, cfg.b_range, cfg.w_range
    if cfg.kind in ("Add", "Sub"):
        return (xa + ba, xb + bb) if cfg.kind == "Add" else (xa - bb, xb - ba)
    if cfg.kind in ("Conv2D", "DepthwiseConv2d", "FullyConnected"):
        s = math.sqrt(k_taps) * max(abs(xa), abs(xb)) * max(abs(wa), abs(wb)) * 0.3
        return (-s, s)
    return tuple(cfg.x_range)  # pools, Mean: the input's range


def _weights(cfg: OpConfig, rng, shape, n_out):
    from maceq.quant import converter as QC

    from maceq.runtime.qtypes import QInfo

    consts = {"w": rng.integers(0, 256, shape, dtype=np.uint8)}
    qinfo = {"w": _qinfo(*_range(cfg, cfg.w_range))}
    if cfg.bias:  # maceq's dsp bias: symmetric over 2^32 levels (MACE's quantize_bias_for_hexagon)
        b, bmn, bmx = QC.mace_quantize_bias(rng.normal(0, 0.5, n_out))
        consts["bias"] = b.astype(np.int32)
        qinfo["bias"] = QInfo(float(np.float32(2 * bmx / 2 ** 32)), 0, float(np.float32(bmn)), float(np.float32(bmx)))
    return consts, qinfo


def _conv_like(cfg: OpConfig, rng):
    n, h, w, c = cfg.in_shape
    kh, kw = cfg.kernel
    if cfg.kind == "FullyConnected":
        consts, qinfo = _weights(cfg, rng, (cfg.out_channels, h, w, c), cfg.out_channels)
        return consts, qinfo, (n, 1, 1, cfg.out_channels), {"transpose_a": 0, "transpose_b": 1}, h * w * c
    dw = cfg.kind == "DepthwiseConv2d"
    o = c * cfg.multiplier if dw else cfg.out_channels
    consts, qinfo = _weights(cfg, rng, (kh, kw, c, cfg.multiplier) if dw else (o, kh, kw, c), o)
    args = {"strides": list(cfg.strides), "kernels": list(cfg.kernel), "padding_values": list(cfg.padding_values),
            "dilations": list(cfg.dilations), "group": c if dw else 1}
    return consts, qinfo, (n, *_out_hw(cfg), o), args, kh * kw * (1 if dw else c)


def make_case(cfg: OpConfig) -> Case:
    """The MACE op (an RtOp as maceq's reader gives it), random u8 inputs and weights from cfg.seed."""
    from maceq.runtime.graph import RtOp

    if cfg.kind not in OP_KINDS:
        raise NnlibError(f"unknown op kind '{cfg.kind}' (one of {', '.join(OP_KINDS)})")
    rng = np.random.default_rng(cfg.seed)
    x = rng.integers(0, 256, cfg.in_shape, dtype=np.uint8)
    inputs, consts, qinfo, args, k_taps = [("x", x, *_range(cfg, cfg.x_range))], {}, {}, {"T": 2}, 1
    if cfg.kind in ("Conv2D", "DepthwiseConv2d", "FullyConnected"):
        consts, qinfo, out_shape, a, k_taps = _conv_like(cfg, rng)
        args.update(a)
        op_type, names = cfg.kind, ["x", "w"] + (["bias"] if cfg.bias else [])
    elif cfg.kind in ("MaxPool", "AvgPool"):
        n, _, _, c = cfg.in_shape
        out_shape, op_type, names = (n, *_out_hw(cfg), c), "Pooling", ["x"]
        args.update({"pooling_type": 2 if cfg.kind == "MaxPool" else 1, "kernels": list(cfg.kernel),
                     "strides": list(cfg.strides), "padding_values": list(cfg.padding_values)})
    elif cfg.kind == "Mean":
        out_shape = tuple(1 if i in cfg.axes else d for i, d in enumerate(cfg.in_shape))
        op_type, names = "Reduce", ["x"]
        args.update({"reduce_type": 0, "axis": list(cfg.axes), "keepdims": 1})
    else:
        b = rng.integers(0, 256, cfg.b_shape or cfg.in_shape, dtype=np.uint8)
        inputs.append(("b", b, *_range(cfg, cfg.b_range)))
        op_type, names = ("Concat", ["x", "b"]) if cfg.kind == "Concat" else ("Eltwise", ["x", "b"])
        if cfg.kind == "Concat":
            out_shape = list(cfg.in_shape)
            out_shape[cfg.axis] += b.shape[cfg.axis]
            args["axis"] = cfg.axis
        else:
            out_shape = np.broadcast_shapes(cfg.in_shape, b.shape)
            args["type"] = 1 if cfg.kind == "Sub" else 0
    out_range = _range(cfg, cfg.out_range if cfg.out_range is not None else _default_out_range(cfg, k_taps))
    op = RtOp("op", op_type, tuple(names), ("y",), args, (_qinfo(*out_range),), (tuple(out_shape),))
    shapes = {t: a.shape for t, a, *_ in inputs} | {k: v.shape for k, v in consts.items()} | {"y": tuple(out_shape)}
    return Case(cfg, op, consts, qinfo, inputs, shapes)


@dataclass
class OpResult:
    y: np.ndarray  # u8 NHWC
    min: float
    max: float
    nodes: list  # nnlib's nodes after prepare


def run_case(case: Case, **kw) -> OpResult:
    """The op on nnlib as MACE encodes it: QuantizeINPUT (u8 + range) -> op -> OUTPUT."""
    ctx = Ctx(case.consts, case.const_qinfo, case.shapes)
    feeds = [Feed(t, a, mn, mx) for t, a, mn, mx in case.inputs]
    net = build_net(ctx, [case.op], feeds, taps=["y"], d32=case.cfg.d32)
    res = run_net(net, **kw)
    y, mn, mx = _read_taps(res, ["y"], ctx)["y"]
    return OpResult(y, mn, mx, [t for _, t in res.nodes if t not in ("QuantizeINPUT_f_to_8", "OUTPUT")])


def maceq_placement_of_case(case: Case) -> tuple:
    """maceq's placement rule for the case: (on_dsp, why) from its dsp kernel's prepare (a raise = not)."""
    from maceq.runtime.model import PrepareContext
    from maceq.runtime.devices import Device, device_spec
    from maceq.runtime.registry import lookup, prepare_op

    q = {t: _qinfo(mn, mx) for t, _, mn, mx in case.inputs} | case.const_qinfo
    try:
        prepared = prepare_op(lookup(case.op.type, Device.DSP)(), case.op, tuple(q[t] for t in case.op.inputs),
                              PrepareContext(device_spec("dsp"), case.consts, case.const_qinfo))
    except Exception as e:  # noqa: BLE001 - maceq's refusal
        return False, f"prepare raises {type(e).__name__}: {str(e).splitlines()[0]}"
    return prepared.placement.device is Device.DSP, prepared.placement.reason


def maceq_case(case: Case):
    """maceq's dsp kernel on the case -> (on_dsp, reason, (y, y_min, y_max)) (placement and result)."""
    from maceq.runtime.model import PrepareContext, QTensor
    from maceq.runtime.ops_dsp import rng
    from maceq.runtime.devices import Device, device_spec
    from maceq.runtime.registry import lookup, prepare_op

    fed = {t: QTensor(a, _qinfo(mn, mx)) for t, a, mn, mx in case.inputs}
    ins = [fed[t] if t in fed else QTensor(case.consts[t], case.const_qinfo[t]) for t in case.op.inputs]
    prepared = prepare_op(lookup(case.op.type, Device.DSP)(), case.op, tuple(t.qinfo for t in ins),
                          PrepareContext(device_spec("dsp"), case.consts, case.const_qinfo))
    out = prepared.run(ins)[0]
    mn, mx = rng(out.qinfo)
    return prepared.placement.device is Device.DSP, prepared.placement.reason, (out.values, mn, mx)


def accepts(cfg: OpConfig, **kw) -> tuple:
    """(True, nnlib's ops after prepare) when MACE's converter maps the op and nnlib prepares and
    executes it; else (False, why)."""
    try:
        r = run_case(make_case(cfg), **kw)
    except N.NnlibError as e:
        return False, str(e).splitlines()[0]
    return True, "/".join(r.nodes)


# ----------------------------------------------------------------------------------------------
# Float reference (what the op means, with maceq's explicit pads) to judge what nnlib computes
# ----------------------------------------------------------------------------------------------

def _deq(codes, mn, mx) -> np.ndarray:
    level = (mx - mn) / 255.0
    return (np.asarray(codes, np.float64) - round(-mn / level)) * level if level > 0 else np.zeros(np.shape(codes))


def model_pads(cfg: OpConfig) -> tuple:
    """(top, left, bottom, right): the padding_values split as maceq splits them (what the model means)."""
    ph, pw = cfg.padding_values
    return ph >> 1, pw >> 1, ph - (ph >> 1), pw - (pw >> 1)


def mace_pads(case: Case) -> tuple:
    """(top, left, bottom, right) nnlib applies for the padding mode MACE's converter chose."""
    from maceq.runtime.kernels.nnlib_ref import Padding, pad_outsize_before_after

    op, cfg = case.op, case.cfg
    mode = Padding(_padding(Ctx(case.consts, case.const_qinfo, case.shapes), op, cfg.kernel, cfg.strides))
    (_, t, b), (_, left, right) = (pad_outsize_before_after(n, k, s, mode) for n, k, s in
                                   zip(case.shapes["x"][1:3], cfg.kernel, cfg.strides))
    return t, left, b, right


def _padded_windows(x, kernel, strides, pads, dil, fill=0.0):
    from numpy.lib.stride_tricks import sliding_window_view

    (t, left, b, right), (kh, kw), (dh, dw) = pads, kernel, dil
    xp = np.pad(x, ((0, 0), (t, b), (left, right), (0, 0)), constant_values=fill)
    ekh, ekw = (kh - 1) * dh + 1, (kw - 1) * dw + 1
    win = sliding_window_view(xp, (ekh, ekw), axis=(1, 2))[:, ::strides[0], ::strides[1]]
    return win[..., ::dh, ::dw]  # [N, OH, OW, C, KH, KW]


def float_reference(case: Case, pads=None) -> np.ndarray:
    """The op in float64 on the dequantized inputs and weights; pads (top, left, bottom, right),
    default the model's (``model_pads``)."""
    cfg, op = case.cfg, case.op
    pads = pads or model_pads(cfg)
    xs = {t: _deq(a, mn, mx) for t, a, mn, mx in case.inputs}
    x = xs["x"]
    w = None
    if "w" in case.consts:
        w = _deq(case.consts["w"], case.const_qinfo["w"].minval, case.const_qinfo["w"].maxval)
    b = 0.0
    if "bias" in case.consts:
        b = case.consts["bias"].astype(np.float64) * (case.const_qinfo["bias"].maxval / 2.0 ** 31)
    if cfg.kind == "FullyConnected":
        return (x.reshape(x.shape[0], -1) @ w.reshape(w.shape[0], -1).T + b).reshape(op.output_shapes[0])
    if cfg.kind in ("Conv2D", "DepthwiseConv2d"):
        win = _padded_windows(x, cfg.kernel, cfg.strides, pads, cfg.dilations)
        if cfg.kind == "Conv2D":
            return np.einsum("nhwcij,oijc->nhwo", win, w) + b
        y = np.einsum("nhwcij,ijcm->nhwcm", win, w)
        return y.reshape(*y.shape[:3], -1) + b
    if cfg.kind == "MaxPool":
        return _padded_windows(x, cfg.kernel, cfg.strides, pads, (1, 1), -np.inf).max(axis=(4, 5))
    if cfg.kind == "AvgPool":
        win = _padded_windows(x, cfg.kernel, cfg.strides, pads, (1, 1), np.nan)
        return np.nanmean(win, axis=(4, 5))
    if cfg.kind == "Mean":
        return x.mean(axis=tuple(cfg.axes), keepdims=True)
    if cfg.kind == "Concat":
        return np.concatenate([x, xs["b"]], axis=cfg.axis)
    return x + xs["b"] if cfg.kind == "Add" else x - xs["b"]


def lsb_error(case: Case, r: OpResult, pads=None) -> int:
    """max |nnlib code - float reference quantized to nnlib's output range| (LSB); -1 on a shape mismatch."""
    y = float_reference(case, pads)
    if y.shape != r.y.shape:
        return -1
    level = (r.max - r.min) / 255.0
    q = np.clip(np.round(y / level) + round(-r.min / level), 0, 255) if level > 0 else np.zeros(y.shape)
    return int(np.abs(q - r.y.astype(np.float64)).max()) if y.size else 0


# ----------------------------------------------------------------------------------------------
# Acceptance: nnlib (prepare + execute) vs maceq's placement rules
# ----------------------------------------------------------------------------------------------

def _same_pv(in_hw, k, s) -> tuple:
    return tuple(max((-(-n // st) - 1) * st + kk - n, 0) for n, kk, st in zip(in_hw, k, s))


def acceptance_configs() -> list:
    """The sweep ``--accept`` runs: conv/depthwise geometry, FC depths, pools, eltwise, concat, mean."""
    cfgs = []
    for k in [(1, 1), (3, 3), (5, 5), (7, 7), (11, 11), (1, 7), (7, 1)]:
        for s in (1, 2, 3, 4):
            cfgs.append(OpConfig("Conv2D", kernel=k, strides=(s, s), padding_values=_same_pv((16, 16), k, (s, s))))
    cfgs += [OpConfig("Conv2D", padding_values=(0, 0)), OpConfig("Conv2D", dilations=(2, 2), padding_values=(4, 4)),
             OpConfig("Conv2D", strides=(2, 2), padding_values=(1, 1)), OpConfig("Conv2D", in_shape=(1, 16, 16, 3)),
             OpConfig("Conv2D", in_shape=(1, 16, 16, 3), strides=(2, 2), padding_values=(1, 1)),
             OpConfig("Conv2D", strides=(2, 1), padding_values=(1, 2))]
    for k in [(1, 1), (2, 2), (3, 3), (5, 5), (7, 7), (9, 9), (1, 3), (3, 1), (3, 7), (7, 3)]:
        for s in (1, 2, 3):
            cfgs.append(OpConfig("DepthwiseConv2d", kernel=k, strides=(s, s),
                                 padding_values=_same_pv((16, 16), k, (s, s))))
    cfgs += [OpConfig("DepthwiseConv2d", multiplier=2), OpConfig("DepthwiseConv2d", padding_values=(0, 0)),
             OpConfig("DepthwiseConv2d", strides=(2, 1), padding_values=(1, 2)),
             OpConfig("DepthwiseConv2d", strides=(2, 2), padding_values=(1, 1)),
             OpConfig("DepthwiseConv2d", kernel=(5, 5), strides=(2, 2), padding_values=(3, 3)),
             OpConfig("DepthwiseConv2d", dilations=(2, 2), padding_values=(4, 4))]
    cfgs += [OpConfig("FullyConnected", in_shape=(1, 1, 1, k), out_channels=o)
             for k, o in [(8, 10), (16, 10), (24, 10), (32, 10), (48, 2), (100, 10), (128, 10), (200, 2), (1280, 1000)]]
    cfgs += [OpConfig("FullyConnected", in_shape=(1, 4, 4, 32), out_channels=10)]
    for kind in ("MaxPool", "AvgPool"):
        cfgs += [OpConfig(kind, kernel=(2, 2), strides=(2, 2), padding_values=(0, 0)),
                 OpConfig(kind, kernel=(3, 3), strides=(2, 2), padding_values=(1, 1)),
                 OpConfig(kind, kernel=(3, 3), strides=(2, 2), padding_values=(2, 2)),
                 OpConfig(kind, kernel=(3, 3), strides=(1, 1), padding_values=(2, 2)),
                 OpConfig(kind, kernel=(16, 16), strides=(1, 1), padding_values=(0, 0))]
    for kind in ("Add", "Sub"):
        cfgs += [OpConfig(kind), OpConfig(kind, d32=True), OpConfig(kind, b_shape=(1, 1, 1, 32)),
                 OpConfig(kind, b_shape=(1, 16, 16, 1))]
    cfgs += [OpConfig("Concat", axis=a) for a in (3, 1, 2)]
    cfgs += [OpConfig("Concat", b_shape=(1, 16, 16, 16)),
             OpConfig("Concat", in_shape=(1, 8, 8, 3), b_shape=(1, 8, 8, 5))]
    cfgs += [OpConfig("Mean", axes=a) for a in ((1, 2), (3,), (1,), (2,))]
    return cfgs


@dataclass
class Acceptance:
    label: str
    nnlib_ok: bool
    nnlib: str  # ops after prepare, or the error
    maceq_on_dsp: bool
    maceq: str  # maceq's fallback reason or error
    lsb: int | None  # nnlib vs the float op with the model's pads (max LSB), when nnlib runs
    lsb_mace: int | None  # the same with the pads of MACE's padding mode (SAME_CAFFE may shift them)
    mismatches: int | None  # nnlib vs maceq's dsp kernel (elements), when maceq places it and runs it
    maceq_run: str = ""  # maceq's dsp kernel's error, when it places the op but cannot run it

    @property
    def nnlib_right(self) -> bool:
        """nnlib runs it and computes the op (with the pads MACE's encoding gives) within 2 LSB."""
        return self.nnlib_ok and self.lsb_mace is not None and 0 <= self.lsb_mace <= 2

    def verdict(self) -> str:
        if not self.nnlib_ok:
            return "DISAGREE" if self.maceq_on_dsp else "agree"
        if not self.nnlib_right:
            return "nnlib runs it wrongly"
        if not self.maceq_on_dsp:
            return "DISAGREE"
        if self.maceq_run:
            return "maceq places it but its kernel raises"
        return "agree" if self.lsb is not None and 0 <= self.lsb <= 2 else "agree (MACE's padding shifts the window)"


def check_acceptance(cfg: OpConfig, **kw) -> Acceptance:
    """nnlib's verdict (prepare + execute, and how far from the float op) vs maceq's placement."""
    case = make_case(cfg)
    try:
        r = run_case(case, **kw)
        ok, detail, lsb = True, "/".join(r.nodes), lsb_error(case, r)
        lsb_mace = lsb if cfg.kind not in ("Conv2D", "DepthwiseConv2d", "MaxPool", "AvgPool") else \
            lsb_error(case, r, mace_pads(case))
    except N.NnlibError as e:
        r, ok, detail, lsb, lsb_mace = None, False, str(e).splitlines()[0], None, None
    on_dsp, why = maceq_placement_of_case(case)
    mism, run_err = None, ""
    if on_dsp:
        try:
            got = maceq_case(case)[2]
            mism = int(np.count_nonzero(got[0] != r.y)) if r is not None and got[0].shape == r.y.shape else None
        except Exception as e:  # noqa: BLE001 - reported
            run_err = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return Acceptance(cfg.label(), ok, detail, on_dsp, why, lsb, lsb_mace, mism, run_err)


# ----------------------------------------------------------------------------------------------
# Comparison with maceq's dsp simulation, inputs, CLI
# ----------------------------------------------------------------------------------------------

@dataclass
class OpCmp:
    op: str
    type: str
    tensor: str
    n: int
    mismatches: int  # elements differing from nnlib
    max_abs: int
    range_ok: bool  # maceq's output (min, max) equals nnlib's in float32
    note: str = ""


def _cmp(op, t, got, want) -> OpCmp:
    (y, mn, mx), (g, gmn, gmx) = want, got
    if g.shape != y.shape:
        return OpCmp(op.name, op.type, t, int(y.size), int(y.size), 255, False, f"shape {g.shape} vs {y.shape}")
    d = np.abs(g.astype(np.int64) - y.astype(np.int64))
    ok = (np.float32(gmn), np.float32(gmx)) == (np.float32(mn), np.float32(mx))
    return OpCmp(op.name, op.type, t, int(y.size), int(np.count_nonzero(d)), int(d.max()) if d.size else 0, ok)


def compare_ops(model, tensors: dict) -> list:
    """Each op with nnlib's inputs and output, run alone in maceq's dsp simulation -> [OpCmp]."""
    from maceq.runtime.model import QTensor
    from maceq.runtime.ops_dsp import qinfo_of_range, rng

    rows = []
    for op in model.ops:
        t = op.outputs[0]
        if t not in tensors or op.type in ("Quantize", "Dequantize"):
            continue
        if any(i not in tensors and i not in model.consts for i in op.inputs):
            continue
        ins = [QTensor(tensors[i][0], qinfo_of_range(tensors[i][1], tensors[i][2])) if i in tensors else None
               for i in op.inputs]
        try:
            out = model.run_op(op, ins, device="dsp")[0]
        except Exception as e:  # noqa: BLE001 - reported as a row
            rows.append(OpCmp(op.name, op.type, t, int(tensors[t][0].size), -1, -1, False, str(e).splitlines()[0]))
            continue
        rows.append(_cmp(op, t, (out.values, *rng(out.qinfo)), tensors[t]))
    return rows


def compare_chain(model, inputs: dict, run: NnlibRun) -> list:
    """maceq's whole dsp simulation vs every nnlib tensor (differences propagate) -> [OpCmp]."""
    from maceq.runtime.ops_dsp import rng

    sim = model.run(inputs, device="dsp", intermediates=True)
    rows = []
    for op in model.ops:
        t = op.outputs[0]
        if t in run.tensors and run.source.get(t) == "nnlib":
            q = sim.tensors[t]
            rows.append(_cmp(op, t, (q.values, *rng(q.qinfo)), run.tensors[t]))
    return rows


def image_input(model, path) -> dict:
    """One image through the preprocessing recorded in the model's .yml -> {input: (1, ...) float32}."""
    from PIL import Image

    from maceq.datasets.preprocess import Preprocess

    pre = Preprocess.from_dict(model.maceq_meta["preprocess"])
    with Image.open(path) as img:
        x = pre.apply(img)
    return {model.input_names[0]: x[None]}


def _print_run(model, inputs, r: NnlibRun, compare: bool):
    print(f"fully on nnlib: {r.fully_on_nnlib}; {len(r.segments)} nnlib graph(s), "
          f"{sum(s.wall_s for s in r.segments):.2f}s under QEMU")
    for name, why in r.rejected.items():
        print(f"  nnlib rejects {name}: {why}")
    for name, typ, why in r.cpu_ops:
        print(f"  in maceq's simulation: {name} ({typ}): {why}")
    for n in r.notes:
        print(f"  note: {n}")
    want = model.run(inputs, device="dsp") if compare else {}
    for name, y in r.outputs.items():
        extra = f", {int(np.count_nonzero(y != want[name]))} differ from maceq" if compare else ""
        print(f"output {name} {tuple(y.shape)}: {np.array2string(y.ravel()[:6], precision=4)}{extra}")
    if compare and r.tensors:
        for title, rows in (("each op alone (nnlib's inputs)", compare_ops(model, r.tensors)),
                            ("maceq's whole simulation", compare_chain(model, inputs, r))):
            bad = [c for c in rows if c.mismatches or not c.range_ok]
            print(f"{title}: {len(bad)} of {len(rows)} ops differ")
            for c in bad:
                print(f"  {c.op} ({c.type}): {c.mismatches}/{c.n} differ (max {c.max_abs})"
                      f"{'' if c.range_ok else ', range differs'} {c.note}")


def _print_acceptance(quiet: bool, **kw):
    rows = [check_acceptance(c, **kw) for c in acceptance_configs()]
    for a in rows:
        if quiet and a.verdict() == "agree":
            continue
        n = f"ok [{a.nnlib}], {a.lsb} LSB from the float op ({a.lsb_mace} with MACE's pads)" if a.nnlib_ok \
            else f"fails: {a.nnlib}"
        m = "dsp" + (f", {a.mismatches} elements differ from nnlib" if a.mismatches is not None else "") + \
            (f", but its kernel raises {a.maceq_run}" if a.maceq_run else "") if a.maceq_on_dsp \
            else f"not on dsp ({a.maceq})"
        print(f"[{a.verdict()}] {a.label}: nnlib {n}; maceq {m}")
    dis = sum(a.verdict() == "DISAGREE" for a in rows)
    print(f"{len(rows)} configurations: nnlib and maceq's placement disagree on {dis}; nnlib runs but computes "
          f"something else on {sum(a.verdict() == 'nnlib runs it wrongly' for a in rows)}; MACE's padding mode "
          f"shifts the window on {sum(a.verdict().startswith('agree (MACE') for a in rows)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="run a maceq dsp model on nnlib (QEMU) as MACE's DSP runtime builds it")
    ap.add_argument("model", nargs="?", help="maceq dsp model (.yml or .pb)")
    ap.add_argument("--image", help="input image (the model's recorded preprocessing)")
    ap.add_argument("--input", help=".npy float input in maceq's layout (NCHW for 4-D)")
    ap.add_argument("--intermediates", action="store_true", help="also every u8 tensor of the graph")
    ap.add_argument("--compare", action="store_true", help="compare with maceq's dsp simulation")
    ap.add_argument("--mapping", choices=("mace", "maceq"), default="mace",
                    help="mace: MACE's converter (default); maceq: maceq's padding rule and Reduce as AvgPool")
    ap.add_argument("--on-reject", choices=("raise", "maceq"), default="raise",
                    help="when nnlib fails on an op: fail (as MACE) or run that op in maceq's simulation")
    ap.add_argument("--accept", action="store_true", help="which op configurations nnlib accepts vs maceq's rules")
    ap.add_argument("--quiet", action="store_true", help="--accept: print only disagreements")
    ap.add_argument("--harness", help=f"default $NNLIB_HARNESS or {N.DEFAULT_HARNESS}")
    a = ap.parse_args(argv)
    try:
        if a.accept:
            _print_acceptance(a.quiet, harness=a.harness)
            return 0
        if not a.model:
            ap.error("a model, or --accept")
        from maceq.runtime import load

        model = load(a.model)
        if a.image:
            inputs = image_input(model, a.image)
        elif a.input:
            inputs = {model.input_names[0]: np.load(a.input, allow_pickle=False)}
        else:
            shape = (1,) + tuple(model.input_shape(model.input_names[0])[1:])
            inputs = {model.input_names[0]: np.random.default_rng(0).normal(0, 1, shape).astype(np.float32)}
        r = run_model(model, inputs, intermediates=a.intermediates or a.compare, harness=a.harness,
                      mapping=MACE if a.mapping == "mace" else MACEQ, on_reject=a.on_reject)
        _print_run(model, inputs, r, a.compare)
    except Exception as e:  # noqa: BLE001 - one-line errors for the CLI
        print(f"mace_graph.py: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
