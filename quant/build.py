"""Optimised float IR + activation ranges -> a uint8 MACE NetDef (cpu profile).

This follows the conventions of the model that MACE's own converter produced
(../shared/data/mace_reference, documented in docs/mace-format.md): NHWC
activations, OHWI Conv2D weights, [KH, KW, C, M] depthwise weights, [O, H, W, C]
FullyConnected weights, ``padding_values`` holding the total padding, a
Quantize op at each input and a Dequantize op at each output, and a
QuantizeActivationInfo on every op.

Every op type emitted here is one that MACE's CPU runtime registers a uint8
kernel for (Conv2D, DepthwiseConv2d, FullyConnected, Eltwise SUM/SUB, Pooling,
Reduce mean, Concat, Softmax, Quantize, Dequantize; quant/safe_forms.py adds
uint8 Pad).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from maceq.errors import MaceqError
from maceq.mace import add_arg, mace_pb2
from maceq.mace.enums import (DataFormat, DataType, EltwiseType, FrameworkType, PoolingType, ReduceType,
                              ResizeCoordinateMode)
from maceq.quant.float_emit import FLOAT_EMITTABLE, cancel_inverse_transposes, emit_float_node
from maceq.quant.ir import ACT_ATTR, Graph, Node
from maceq.quant.scheme import adjust_range, scheme_for
from maceq.runtime.devices import Device, device_spec
from maceq.runtime.qtypes import QInfo
from maceq.runtime.kernels.resize import onnx_resize_mapping

INPUT_PREFIX, OUTPUT_PREFIX = "mace_input_node_", "mace_output_node_"
#: Net-level arguments exactly as MACE's converter writes them for an ONNX model on the CPU.
NET_ARGS = (("filter_format", DataFormat.OHWI), ("data_format", DataFormat.NCHW),
            ("framework_type", FrameworkType.ONNX), ("opencl_mem_type", 2), ("runtime_type", 0), ("quantize_flag", 1))
ELTWISE_TYPES = {"Add": EltwiseType.SUM, "Sub": EltwiseType.SUB}
UINT8, FLOAT = "uint8", "float32"
VIEW_OPS = ("Flatten", "Reshape", "Squeeze")  # ops that only relabel a tensor: it keeps its producer's scale


@dataclass
class BuiltModel:
    """A MACE model in memory: the proto, the weight arrays by name, the ranges used."""

    multi_net_def: object
    arrays: dict[str, np.ndarray]
    ranges: dict[str, tuple[float, float]]
    op_sources: dict[str, str] = field(default_factory=dict)  # MACE op name -> IR node name
    tensor_map: dict[str, str] = field(default_factory=dict)  # MACE tensor -> IR tensor, where names differ


def _nhwc(shape) -> list[int]:
    """An ONNX activation shape in MACE's NHWC order (4-D), unchanged otherwise."""
    shape = list(shape)
    return [shape[0], shape[2], shape[3], shape[1]] if len(shape) == 4 else shape


def _total_pads(node: Node) -> list[int]:
    """MACE ``padding_values`` (total per axis) of a node's ONNX pads; MaceqError when MACE cannot express them."""
    t, l, b, r = (list(node.attr("pads", [0, 0, 0, 0])) + [0] * 4)[:4]
    for lead, trail, what in ((t, b, "top/bottom"), (l, r, "left/right")):
        if lead != (lead + trail) >> 1:
            raise MaceqError(f"node '{node.name}': {what} pads ({lead}, {trail}) cannot be expressed as MACE "
                             "padding_values (leading pad must be total >> 1)")
    return [t + b, l + r]


class MaceBuilder:
    """Builds one NetDef from an optimised IR graph for one device (its spec's scheme and placement)."""

    def __init__(self, graph: Graph, ranges: dict[str, tuple[float, float]], shapes: dict[str, tuple[int, ...]],
                 *, model_name: str, device: Device = Device.CPU):
        self.device = Device.parse(device)
        self.scheme = scheme_for(self.device)
        self.g = graph
        self.ranges = ranges
        self.shapes = shapes
        self.model_name = model_name
        self.net = mace_pb2.NetDef()
        self.arrays: dict[str, np.ndarray] = {}
        self.qinfo: dict[str, QInfo] = {}
        self.rename: dict[str, str] = {}  # IR tensor -> MACE tensor (views, inputs)
        self.view_src: dict[str, str] = {}  # Flatten/Reshape output -> its input (folded into FC)
        self.op_sources: dict[str, str] = {}
        self.used_ranges: dict[str, tuple[float, float]] = {}
        self.float_name: dict[str, str] = {}  # IR tensor -> MACE name of its float32 version
        self.tensor_map: dict[str, str] = {}  # MACE tensor -> the IR tensor it holds, where the names differ
        self.placement: dict[str, str] = {}

    # -- precision boundaries ------------------------------------------------------
    def _quantize_op(self, src: str, qname: str, tensor: str, *, find_range: bool, data_format: DataFormat) -> str:
        """A Quantize op making the uint8 tensor ``qname`` from the float ``src`` (IR tensor ``tensor``)."""
        op = self.net.op.add()
        op.input.append(src)
        op.output.append(qname)
        op.name = qname
        op.type = "Quantize"
        add_arg(op, "T", DataType.DT_UINT8)
        add_arg(op, "data_format", data_format)
        add_arg(op, "find_range_every_time", int(find_range))
        op.output_shape.add().dims.extend(_nhwc(self.shapes[tensor]))
        p = self._range_q(tensor)
        self._qinfo_msg(op, p)
        self.qinfo[qname] = p
        self.rename[tensor] = qname
        self.op_sources[qname] = tensor
        self.tensor_map[qname] = tensor
        return qname

    def _as_uint8(self, tensor: str) -> str:
        """The MACE name of ``tensor``'s uint8 version, inserting a Quantize op after a float producer."""
        if tensor in self.rename:
            return self.rename[tensor]
        src = self.float_name.get(tensor)
        if src is None:
            raise MaceqError(f"tensor '{tensor}' is used before it is produced")
        return self._quantize_op(src, tensor + "__quant", tensor, find_range=False, data_format=DataFormat.AUTO)

    def _dequantize(self, tensor: str, src: str, *, out_name: str, op_name: str) -> str:
        """A Dequantize op making the float ``out_name`` from the uint8 ``src`` (IR tensor ``tensor``)."""
        prod = next(op for op in self.net.op if src in op.output)
        op = self.net.op.add()
        op.input.append(src)
        op.output.append(out_name)
        op.name = op_name
        op.type = "Dequantize"
        add_arg(op, "T", DataType.DT_UINT8)
        add_arg(op, "data_format", DataFormat.NHWC if len(self.shapes[tensor]) == 4 else DataFormat.NONE)
        op.output_shape.add().dims.extend(list(prod.output_shape[0].dims))
        op.output_type.append(DataType.DT_FLOAT)
        self.op_sources[op_name] = tensor
        if out_name != tensor:
            self.tensor_map[out_name] = tensor
        return out_name

    def _as_float(self, tensor: str) -> str:
        """The MACE name of ``tensor``'s float32 version, inserting a Dequantize op after a uint8 producer."""
        if tensor in self.float_name:
            return self.float_name[tensor]
        src = self.rename.get(tensor)
        if src is None:
            raise MaceqError(f"tensor '{tensor}' is used before it is produced")
        name = self._dequantize(tensor, src, out_name=tensor + "__dequant", op_name=tensor + "__dequant")
        self.float_name[tensor] = name
        return name

    def _emit_float(self, node: Node) -> None:
        """A float32 MACE op (T=DT_FLOAT) for ``node``; its operands are dequantized as needed."""
        # One MACE name per IR input; constant operands are read from the graph by the emitter.
        ins = [i if (not i or self.g.is_const(i)) else self._as_float(i) for i in node.inputs]
        outs = list(node.outputs)
        emission = emit_float_node(node, graph=self.g, shapes=self.shapes, inputs=ins,
                                   output=outs if len(outs) > 1 else outs[0], op_name=node.name)
        for op in emission.ops:
            self.net.op.add().CopyFrom(op)
            self.op_sources[op.name] = node.name
        for tensor, arr in emission.tensors:
            self.net.tensors.add().CopyFrom(tensor)
            self.arrays[tensor.name] = arr
        for out in outs:
            self.float_name[out] = out

    # -- helpers -----------------------------------------------------------
    def _range_q(self, tensor: str) -> QInfo:
        """The device scheme's quantization of ``tensor``'s calibrated range (recorded as used)."""
        if tensor not in self.ranges:
            raise MaceqError(f"tensor '{tensor}' has no calibrated range")
        lo, hi = self.ranges[tensor]
        self.used_ranges[tensor] = (float(lo), float(hi))
        return self.scheme.activation(lo, hi)

    def _qinfo_msg(self, op, p: QInfo):
        """Append ``p`` to ``op``'s quantize_info."""
        qi = op.quantize_info.add()
        qi.scale, qi.zero_point, qi.minval, qi.maxval = p.scale, p.zero_point, p.minval, p.maxval

    def _add_const(self, name: str, arr: np.ndarray, dtype: DataType, p: QInfo | None):
        """Add a const tensor (quantized when ``p`` is given) and its array."""
        t = self.net.tensors.add()
        t.dims.extend(int(d) for d in arr.shape)
        t.data_type = dtype
        t.name = name
        if p is not None:
            t.scale, t.zero_point, t.minval, t.maxval = p.scale, p.zero_point, p.minval, p.maxval
            t.quantized = True
        self.arrays[name] = arr

    def _new_op(self, node_name: str, op_type: str, inputs, outputs, *, source: str | None = None):
        """Append a uint8 op (T = DT_UINT8) whose source node is ``source`` (default: its own name)."""
        op = self.net.op.add()
        op.input.extend(inputs)
        op.output.extend(outputs)
        op.name = node_name
        op.type = op_type
        add_arg(op, "T", DataType.DT_UINT8)
        self.op_sources[node_name] = source if source is not None else node_name
        return op

    def _common(self, op):
        """The framework_type and data_format args every uint8 compute op carries."""
        add_arg(op, "framework_type", FrameworkType.ONNX)
        add_arg(op, "data_format", DataFormat.AUTO)

    def _src(self, tensor: str) -> str:
        """The MACE name of an IR tensor already emitted in uint8."""
        return self.rename.get(tensor, tensor)

    def _in_q(self, tensor: str) -> QInfo:
        """The quantization of an IR tensor already emitted in uint8."""
        return self.qinfo[self._src(tensor)]

    def _finish(self, op, node: Node, out_tensor: str, p: QInfo):
        """Give ``op`` its NHWC output shape and output quantization ``p``."""
        shape = self.shapes.get(out_tensor)
        if shape is None:
            raise MaceqError(f"node '{node.name}': unknown shape of output '{out_tensor}'")
        op.output_shape.add().dims.extend(_nhwc(shape))
        self._qinfo_msg(op, p)
        self.qinfo[op.output[0]] = p

    # -- per-op emitters -----------------------------------------------------
    def _weights_and_bias(self, node: Node, w_mace: np.ndarray, bias: np.ndarray | None, *,
                          depthwise: bool = False):
        """Quantize the weights and the bias with the device's scheme (quant/scheme.py)."""
        qw = self.scheme.weights(w_mace, out_axis_last_two=depthwise)
        wname = node.inputs[1]
        if qw.params is not None:
            self._add_const(wname, qw.codes, DataType.DT_UINT8, qw.params)
        else:
            self._add_const(wname, qw.codes.astype(np.int8), DataType.DT_INT8,
                            QInfo(float(qw.channel_scales.max()), 0, 0.0, 0.0))
        names = [wname]
        n_out = w_mace.shape[2] * w_mace.shape[3] if depthwise else w_mace.shape[0]
        if bias is None:
            bias = np.zeros(n_out, np.float32)
        # transformer.py: scale = quantize_info[input].scale * consts[filter].scale, both float32 fields.
        s_in = float(np.float32(self._in_q(node.inputs[0]).scale))
        qb, bp = self.scheme.bias(bias, s_in, qw)
        bname = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else node.name + "_bias"
        self._add_const(bname, qb, DataType.DT_INT32, bp)
        names.append(bname)
        if qw.channel_scales is not None:
            sname = wname + "__scales"
            self._add_const(sname, qw.channel_scales.astype(np.float32), DataType.DT_FLOAT, None)
            names.append(sname)
        return names

    def _is_depthwise(self, node: Node) -> bool:
        """Whether a Conv node is a depthwise convolution (one filter per input channel)."""
        w = self.g.const(node.inputs[1])
        group = int(node.attr("group", 1))
        return group > 1 and w.shape[1] == 1 and group == self.shapes[node.inputs[0]][1]

    def _check_conv(self, node: Node, depthwise: bool):
        """Refuse the Conv forms MACE's uint8 Conv2D / DepthwiseConv2d cannot run."""
        if node.attr("auto_pad", "NOTSET") not in ("NOTSET", ""):
            raise MaceqError(f"node '{node.name}' (Conv): auto_pad={node.attr('auto_pad')} is not supported; "
                             "re-export with explicit pads")
        group = int(node.attr("group", 1))
        if not depthwise and group != 1:
            raise MaceqError(f"node '{node.name}' (Conv): grouped convolution (group={group}) has no uint8 kernel "
                             "in MACE's CPU runtime")
        if not depthwise and any(int(d) != 1 for d in node.attr("dilations", [1, 1])):
            raise MaceqError(f"node '{node.name}' (Conv): MACE's uint8 Conv2D rejects dilation > 1")

    def emit_conv(self, node: Node, out_name: str, op_name: str):
        """Conv: Conv2D with OHWI weights, or DepthwiseConv2d with [KH, KW, C, M] weights."""
        if not self.g.is_const(node.inputs[1]):
            raise MaceqError(f"node '{node.name}' (Conv): weights are not constant")
        w = self.g.const(node.inputs[1]).astype(np.float32)  # OIHW
        if w.ndim != 4:
            raise MaceqError(f"node '{node.name}' (Conv): only 2-D convolution is supported")
        bias = self.g.const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        depthwise = self._is_depthwise(node)
        group = int(node.attr("group", 1))
        if depthwise:
            c = w.shape[0] // group
            w_mace = w.reshape(group, c, w.shape[2], w.shape[3]).transpose(2, 3, 0, 1)  # [KH, KW, C, M]
        else:
            w_mace = w.transpose(0, 2, 3, 1)  # OHWI
        self._check_conv(node, depthwise)
        op = self._new_op(op_name, "DepthwiseConv2d" if depthwise else "Conv2D", [], [out_name], source=node.name)
        op.input.append(self._src(node.inputs[0]))
        op.input.extend(self._weights_and_bias(node, w_mace, bias, depthwise=depthwise))
        self._common(op)
        add_arg(op, "strides", node.attr("strides", [1, 1]))
        add_arg(op, "kernels", list(w.shape[2:]))
        add_arg(op, "padding_values", _total_pads(node))
        add_arg(op, "group", group)
        add_arg(op, "dilations", node.attr("dilations", [1, 1]))
        self._activation_args(op, node)
        self._finish(op, node, node.outputs[0], self._range_q(node.outputs[0]))

    def _activation_args(self, op, node: Node):
        """A fused ReLU / ReLUX as MACE activation args."""
        act = node.attr(ACT_ATTR)
        if act is None:
            return
        lo, hi = act
        if lo == 0.0 and math.isinf(hi):
            add_arg(op, "activation", "RELU")
        elif lo == 0.0:
            add_arg(op, "activation", "RELUX")
            add_arg(op, "max_limit", float(hi))
        # Other clamps act only through the output range (MACE's uint8 kernels ignore
        # the activation args anyway, see docs/semantics.md).

    def _fc_input(self, node: Node) -> tuple[str, tuple[int, ...]]:
        """(the IR tensor FullyConnected reads, its shape): a folded view's input replaces the view."""
        src = node.inputs[0]
        if src in self.view_src:
            return self.view_src[src], self.shapes[self.view_src[src]]
        return src, self.shapes[src]

    def _fc_weights(self, node: Node, in_shape) -> tuple[np.ndarray, np.ndarray | None]:
        """(the FullyConnected weight [O, H, W, C] in NHWC flatten order, the bias or None), alpha and beta folded."""
        if not self.g.is_const(node.inputs[1]):
            raise MaceqError(f"node '{node.name}' ({node.op_type}): the weight matrix is not constant")
        if node.attr("transA", 0):
            raise MaceqError(f"node '{node.name}' (Gemm): transA=1 is not supported")
        w = self.g.const(node.inputs[1]).astype(np.float64)
        if node.op_type == "MatMul" or not node.attr("transB", 0):
            w = w.T
        w = w * float(node.attr("alpha", 1.0))
        bias = None
        if len(node.inputs) > 2 and node.inputs[2]:
            if not self.g.is_const(node.inputs[2]):
                raise MaceqError(f"node '{node.name}' (Gemm): bias is not constant")
            bias = np.broadcast_to(self.g.const(node.inputs[2]).astype(np.float64) * float(node.attr("beta", 1.0)),
                                   (w.shape[0],))
        o = w.shape[0]
        if len(in_shape) == 4:
            _, c, h, wd = in_shape
            if c * h * wd != w.shape[1]:
                raise MaceqError(f"node '{node.name}': weight columns {w.shape[1]} != flattened input {c * h * wd}")
            return w.reshape(o, c, h, wd).transpose(0, 2, 3, 1), bias
        if len(in_shape) == 2:
            return w.reshape(o, 1, 1, w.shape[1]), bias
        raise MaceqError(f"node '{node.name}': FullyConnected input of rank {len(in_shape)} is not supported")

    def emit_gemm(self, node: Node, out_name: str, op_name: str):
        """Gemm / MatMul with a constant weight: FullyConnected (reading through a folded Flatten/Reshape)."""
        src, in_shape = self._fc_input(node)
        w_mace, bias = self._fc_weights(node, in_shape)
        o = w_mace.shape[0]
        op = self._new_op(op_name, "FullyConnected", [self._src(src)], [out_name], source=node.name)
        node_for_q = Node(node.name, node.op_type, [src] + node.inputs[1:], node.outputs, node.attrs)
        op.input.extend(self._weights_and_bias(node_for_q, w_mace.astype(np.float32), bias))
        self._common(op)
        add_arg(op, "transpose_a", 0)
        add_arg(op, "transpose_b", 1)
        self._activation_args(op, node)
        shape = (in_shape[0], o, 1, 1)
        self.shapes[node.outputs[0] + "__fc4d"] = shape
        op.output_shape.add().dims.extend([shape[0], 1, 1, o])
        p = self._range_q(node.outputs[0])
        self._qinfo_msg(op, p)
        self.qinfo[out_name] = p

    def emit_eltwise(self, node: Node, out_name: str, op_name: str):
        """Add / Sub of two activations: Eltwise SUM / SUB."""
        for i in node.inputs:
            if self.g.is_const(i):
                raise MaceqError(f"node '{node.name}' ({node.op_type}): a constant operand is not supported "
                                 "by MACE's uint8 Eltwise")
        op = self._new_op(op_name, "Eltwise", [self._src(i) for i in node.inputs], [out_name], source=node.name)
        self._common(op)
        add_arg(op, "type", ELTWISE_TYPES[node.op_type])
        add_arg(op, "has_data_format", 1)
        self._finish(op, node, node.outputs[0], self._range_q(node.outputs[0]))

    def emit_global_pool(self, node: Node, out_name: str, op_name: str):
        """GlobalAveragePool: Reduce MEAN over H and W, keeping them."""
        op = self._new_op(op_name, "Reduce", [self._src(node.inputs[0])], [out_name], source=node.name)
        self._common(op)
        add_arg(op, "reduce_type", ReduceType.MEAN)
        add_arg(op, "axis", [1, 2])
        add_arg(op, "keepdims", 1)
        add_arg(op, "has_data_format", 1)
        # transformer.py add_quantize_tensor_range: Reduce copies its producer's quantize info.
        self._finish(op, node, node.outputs[0], self._in_q(node.inputs[0]))

    def emit_pool(self, node: Node, out_name: str, op_name: str):
        """MaxPool / AveragePool: Pooling MAX / AVG."""
        if node.attr("ceil_mode", 0):
            raise MaceqError(f"node '{node.name}' ({node.op_type}): ceil_mode=1 is not supported")
        if node.op_type == "AveragePool" and node.attr("count_include_pad", 0) and any(node.attr("pads", [0])):
            raise MaceqError(f"node '{node.name}' (AveragePool): count_include_pad=1 with padding is not supported")
        op = self._new_op(op_name, "Pooling", [self._src(node.inputs[0])], [out_name], source=node.name)
        self._common(op)
        add_arg(op, "pooling_type", PoolingType.AVG if node.op_type == "AveragePool" else PoolingType.MAX)
        add_arg(op, "kernels", node.attr("kernel_shape"))
        add_arg(op, "strides", node.attr("strides", [1, 1]))
        add_arg(op, "padding_values", _total_pads(node))
        add_arg(op, "dilations", node.attr("dilations", [1, 1]))
        add_arg(op, "round_mode", 0)
        self._finish(op, node, node.outputs[0], self._in_q(node.inputs[0]))

    def emit_concat(self, node: Node, out_name: str, op_name: str):
        """Concat on the NHWC axis."""
        rank = len(self.shapes[node.outputs[0]])
        axis = int(node.attr("axis", 1)) % rank
        if rank == 4:
            axis = [0, 3, 1, 2][axis]
        op = self._new_op(op_name, "Concat", [self._src(i) for i in node.inputs], [out_name], source=node.name)
        self._common(op)
        add_arg(op, "axis", axis)
        self._finish(op, node, node.outputs[0], self._range_q(node.outputs[0]))

    def emit_softmax(self, node: Node, out_name: str, op_name: str):
        """Softmax over the last (NHWC: channel) axis."""
        rank = len(self.shapes[node.outputs[0]])
        if int(node.attr("axis", -1)) % rank != rank - 1 and rank != 4:
            raise MaceqError(f"node '{node.name}' (Softmax): only the last axis is supported")
        op = self._new_op(op_name, "Softmax", [self._src(node.inputs[0])], [out_name], source=node.name)
        self._common(op)
        # transformer.py: Softmax output quantize info is adjust_range(0, 1).
        self._finish(op, node, node.outputs[0], adjust_range(0.0, 1.0, non_zero=False))

    def emit_resize(self, node: Node, out_name: str, op_name: str):
        """A linear Resize / Upsample that MACE's uint8 kernel computes exactly: ResizeBilinear."""
        m = _resize_mapping(self.g, node, self.shapes).mace
        op = self._new_op(op_name, "ResizeBilinear", [self._src(node.inputs[0])], [out_name], source=node.name)
        self._common(op)
        add_arg(op, "size", list(self.shapes[node.outputs[0]][2:]))
        add_arg(op, "align_corners", int(m.align_corners))
        if m.coordinate_mode != ResizeCoordinateMode.NONE:
            add_arg(op, "coordinate_transformation_mode", ResizeCoordinateMode(m.coordinate_mode))
        if m.scale_hw is not None:
            add_arg(op, "height_scale", float(m.scale_hw[0]))
            add_arg(op, "width_scale", float(m.scale_hw[1]))
        # transformer.py add_quantize_tensor_range: ResizeBilinear copies its producer's quantize info.
        self._finish(op, node, node.outputs[0], self._in_q(node.inputs[0]))

    EMITTERS = {"Conv": emit_conv, "Resize": emit_resize, "Upsample": emit_resize, "Gemm": emit_gemm,
                "MatMul": emit_gemm, "Add": emit_eltwise, "Sub": emit_eltwise, "GlobalAveragePool": emit_global_pool,
                "MaxPool": emit_pool, "AveragePool": emit_pool, "Concat": emit_concat, "Softmax": emit_softmax}

    # -- whole graph ---------------------------------------------------------------
    def build(self, *, strict: bool = False, fp32=frozenset()) -> BuiltModel:
        """The whole model: each node in its placement, Quantize / Dequantize at the boundaries, the net's info."""
        self.view_src, self.placement = place_nodes(self.g, device=self.device, strict=strict, shapes=self.shapes,
                                                    fp32=fp32)
        self._quantize_inputs()
        for node in self.g.nodes:
            if node.name in self.placement:  # else: a view folded into FullyConnected
                self._emit_node(node)
        self._dequantize_outputs()
        self._cancel_transposes()
        self._sort_tensors()
        for name, value in NET_ARGS:
            add_arg(self.net, name, value)
        self.net.data_type = DataType.DT_FLOAT
        self.net.name = "default_graph"
        self.net.infer_order = 0
        self._input_info()
        self._output_info()
        multi = mace_pb2.MultiNetDef()
        multi.net_def.append(self.net)
        multi.input_tensor.extend(vi.name for vi in self.g.inputs)
        multi.output_tensor.extend(self.g.outputs)
        return BuiltModel(multi, self.arrays, dict(self.used_ranges), self.op_sources, dict(self.tensor_map))

    def _quantize_inputs(self):
        """Name each graph input as its float version; quantize those a uint8 op reads.

        MACE's input Quantize recomputes its range from every input (find_range_every_time).
        """
        consumers = self.g.consumers()
        for vi in self.g.inputs:
            self.float_name[vi.name] = vi.name
            if any(self.placement.get(c.name) == UINT8 for c in consumers.get(vi.name, [])):
                self._quantize_op(vi.name, INPUT_PREFIX + vi.name, vi.name, find_range=True,
                                  data_format=DataFormat.NHWC)

    def _emit_node(self, node: Node):
        """The MACE op(s) of one placed node: its uint8 emitter (operands quantized first) or the float path."""
        if self.placement[node.name] != UINT8:
            self._emit_float(node)
            return
        if len(node.outputs) != 1:
            raise MaceqError(f"node '{node.name}' ({node.op_type}): {len(node.outputs)} outputs are not supported")
        for i in node.inputs:
            t = self.view_src.get(i, i)
            if t and not self.g.is_const(t):
                self._as_uint8(t)
        out = node.outputs[0]
        is_out = out in self.g.outputs
        out_name = OUTPUT_PREFIX + out if is_out else out
        op_name = OUTPUT_PREFIX + node.name if is_out else node.name
        self.EMITTERS[node.op_type](self, node, out_name, op_name)
        self.rename[out] = out_name
        if out_name != out:
            self.tensor_map[out_name] = out

    def _dequantize_outputs(self):
        """A Dequantize op for each graph output produced in uint8 (a float output is already named as it)."""
        for out in self.g.outputs:
            if out in self.float_name and out not in self.rename:
                continue
            src = self.rename.get(out)
            if src is None:
                raise MaceqError(f"graph output '{out}' is not produced by any emitted op")
            self._dequantize(out, src, out_name=out, op_name=out)

    def _cancel_transposes(self):
        """Drop the back-to-back NHWC<->NCHW transposes between consecutive float ops."""
        kept = []
        for op in cancel_inverse_transposes(list(self.net.op), keep=set(self.g.outputs)):
            c = mace_pb2.OperatorDef()
            c.CopyFrom(op)
            kept.append(c)
        del self.net.op[:]
        self.net.op.extend(kept)

    def _sort_tensors(self):
        """Put the const tensors in the source model's initializer order, as MACE's converter keeps them."""
        order = {name: k for k, name in enumerate(self.g.initializers)}
        tensors = sorted(self.net.tensors, key=lambda t: order.get(t.name, len(order)))
        copies = [type(t)() for t in tensors]
        for c, t in zip(copies, tensors):
            c.CopyFrom(t)
        del self.net.tensors[:]
        self.net.tensors.extend(copies)

    def _input_info(self):
        """The net's input_info: NHWC float inputs, with the input Quantize's scale and zero point."""
        for vi in self.g.inputs:
            info = self.net.input_info.add()
            info.name = vi.name
            info.dims.extend(_nhwc(self.shapes[vi.name]))
            info.data_type = DataType.DT_FLOAT
            info.data_format = DataFormat.NHWC
            if INPUT_PREFIX + vi.name in self.qinfo:
                p = self.qinfo[INPUT_PREFIX + vi.name]
                info.scale, info.zero_point = p.scale, p.zero_point
            info.alias = vi.name

    def _output_info(self):
        """The net's output_info: float outputs, with the uint8 producer's scale and zero point."""
        for out in self.g.outputs:
            info = self.net.output_info.add()
            info.name = out
            info.dims.extend(_nhwc(self.shapes[out]))
            info.data_type = DataType.DT_FLOAT
            info.data_format = DataFormat.NHWC if len(self.shapes[out]) == 4 else DataFormat.NONE
            if out in self.rename:
                p = self.qinfo[self.rename[out]]
                info.scale, info.zero_point = p.scale, p.zero_point
            info.alias = out


def _resize_mapping(g: Graph, node: Node, shapes):
    """The ONNX Resize mapping for a linear Resize/Upsample with constant scales/sizes, else None."""
    x, out = node.inputs[0], node.outputs[0]
    if x not in shapes or out not in shapes or len(shapes[x]) != 4:
        return None
    mode = str(node.attr("mode", "nearest"))
    if mode not in ("linear", "bilinear"):
        return None
    scales = None
    for idx in (2, 1):  # Resize-11+: (X, roi, scales, sizes); Upsample: (X, scales)
        if len(node.inputs) > idx and node.inputs[idx] and g.is_const(node.inputs[idx]):
            v = np.asarray(g.const(node.inputs[idx]), dtype=np.float32).ravel()
            if v.size == 4 and (idx == 2 or node.op_type == "Upsample"):
                scales = (float(v[2]), float(v[3]))
                break
    ctm = "asymmetric" if node.op_type == "Upsample" else str(node.attr("coordinate_transformation_mode",
                                                                        "half_pixel"))
    try:
        return onnx_resize_mapping(mode=mode, coordinate_transformation_mode=ctm,
                                   nearest_mode=str(node.attr("nearest_mode", "round_prefer_floor")),
                                   in_hw=tuple(shapes[x][2:]), out_hw=tuple(shapes[out][2:]),
                                   scales_hw=scales, node=node.name)
    except MaceqError:
        return None


def uint8_capable(g: Graph, node: Node, shapes=None, *, uint8_resize: bool = True) -> bool:
    """Whether the device runs this node in uint8 as the writer would emit it (MACE's CPU op set;
    ``uint8_resize=False`` for devices with no integer ResizeBilinear)."""
    if node.op_type in ("Resize", "Upsample"):
        if not uint8_resize:
            return False
        m = _resize_mapping(g, node, shapes or {})
        return m is not None and m.mace is not None
    if node.op_type not in MaceBuilder.EMITTERS:
        return False
    if node.op_type in ("Add", "Sub") and any(g.is_const(i) for i in node.inputs):
        return False
    if node.op_type == "Conv":
        return _conv_uint8_capable(g, node, shapes or {})
    if node.op_type == "Softmax":
        return _softmax_uint8_capable(g, node, shapes or {})
    if node.op_type in ("Gemm", "MatMul"):
        # MACE's uint8 FullyConnected: constant weights on a 2-D input (or a view of a 4-D one);
        # a sequence [N, T, C] (transformer-style text recognizers) takes the float MatMul.
        shape = (shapes or {}).get(node.inputs[0])
        return len(node.inputs) > 1 and g.is_const(node.inputs[1]) and (shape is None or len(shape) == 2)
    return True


def _conv_uint8_capable(g: Graph, node: Node, shapes: dict) -> bool:
    """MACE's uint8 Conv2D has no groups and no dilation (its DepthwiseConv2d has dilation): such a
    convolution runs on the float path, where MACE's float Conv2D and the group split handle it."""
    if len(node.inputs) < 2 or not g.is_const(node.inputs[1]):
        return True  # the writer names the problem
    w, group = g.const(node.inputs[1]), int(node.attr("group", 1))
    in_shape = shapes.get(node.inputs[0])
    depthwise = group > 1 and w.ndim == 4 and w.shape[1] == 1 and in_shape is not None and group == in_shape[1]
    if depthwise:
        return True
    return group == 1 and all(int(d) == 1 for d in node.attr("dilations", [1, 1]))


def _softmax_uint8_capable(g: Graph, node: Node, shapes: dict) -> bool:
    """MACE's uint8 Softmax takes ranks 2 and 4 and runs over the stored last axis: the ONNX axis 1
    of a 2-D tensor, or of a 4-D one (stored NHWC); any other softmax runs on the float path."""
    shape = shapes.get(node.inputs[0])
    if shape is None:
        return True  # the writer names the problem
    r = len(shape)
    if r not in (2, 4):
        return False
    axis = int(node.attr("axis", -1 if g.opset >= 13 else 1)) % r
    return axis == 1 and (g.opset >= 13 or int(np.prod(shape[2:])) == 1)


def node_names(node: Node) -> list[str]:
    """Every name a user may call a node by: its name, the names of nodes fused into it, its outputs."""
    return [node.name, *node.attrs.get("maceq_names", []), *node.outputs]


def select_nodes(g: Graph, patterns) -> set[str]:
    """Names of the nodes any of the globs matches (fnmatch on :func:`node_names`)."""
    import fnmatch

    return {n.name for n in g.nodes
            if any(fnmatch.fnmatchcase(name, p) for p in patterns for name in node_names(n))}


def place_nodes(g: Graph, *, device: Device, strict: bool = False, shapes=None, fp32=frozenset()
                ) -> tuple[dict[str, str], dict[str, str]]:
    """Decide where each node runs on ``device``: ``uint8`` (a MACE uint8 kernel) or ``float32``
    (float fallback); the device's spec says which ops it has in uint8.

    Returns (views folded into FullyConnected: output -> input, placement by node name).
    A node with no uint8 kernel falls back to a float32 op with Dequantize/Quantize around it;
    with ``strict`` that is an error naming the node. A node neither path supports is an error.
    Nodes named in ``fp32`` (user exemptions, mixed precision) run in float32 whatever their kernel.
    """
    spec = device_spec(device)
    uint8_resize, where = spec.uint8_resize, spec.device.value
    consumers = g.consumers()
    views, placement = {}, {}
    for node in g.nodes:
        if node.op_type in VIEW_OPS:
            cons = consumers.get(node.outputs[0], [])
            if (cons and all(c.op_type in ("Gemm", "MatMul") and c.name not in fp32
                             and uint8_capable(g, c, shapes, uint8_resize=uint8_resize)
                             for c in cons)
                    and node.outputs[0] not in g.outputs):
                views[node.outputs[0]] = node.inputs[0]
                continue
        if node.name not in fp32 and uint8_capable(g, node, shapes, uint8_resize=uint8_resize):
            placement[node.name] = UINT8
            continue
        if node.op_type not in FLOAT_EMITTABLE:
            raise MaceqError(f"node '{node.name}': unsupported op type '{node.op_type}' for the {where} device (MACE has "
                             f"no kernel for it, uint8 or float, and maceq knows no exact rewrite into MACE ops)")
        if node.name in fp32:
            placement[node.name] = FLOAT
            continue
        if strict:
            raise MaceqError(f"node '{node.name}' ({node.op_type}): no uint8 kernel on the {where} device; "
                             "it would fall back to float32 (refused by --strict)")
        placement[node.name] = FLOAT
    return views, placement


def check_supported(g: Graph, *, device: Device, strict: bool = False, shapes=None, fp32=frozenset()
                    ) -> dict[str, str]:
    """Raise MaceqError naming the first node the writer cannot emit for ``device``; return the placement."""
    return place_nodes(g, device=device, strict=strict, shapes=shapes, fp32=fp32)[1]


def build_mace_model(graph: Graph, ranges: dict[str, tuple[float, float]], shapes: dict[str, tuple[int, ...]],
                     *, model_name: str, strict: bool = False, fp32=frozenset(), device: Device = Device.CPU
                     ) -> BuiltModel:
    return MaceBuilder(graph, ranges, dict(shapes), model_name=model_name, device=device).build(
        strict=strict, fp32=fp32)
