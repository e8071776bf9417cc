"""Rewrite ops that the device computes wrongly into an equivalent form it computes right.

The cases known today (docs/semantics.md):

- cpu, "the 3x3 fast path": a uint8 3x3 depthwise convolution with padding 1 that takes TFLite's
  aarch64 fast path on MACE's CPU runtime while its last window does not hang one position past
  the input (stride 2 on an even size). The device then computes the last output row and column
  from a shifted or truncated window.
- dsp, "Geometry": a convolution or pooling whose explicit pads put an odd total after the input
  (TensorFlow's SAME): MACE's Hexagon converter runs it SAME_CAFFE, with the pad before the input.

The safe form is an explicit uint8 ``Pad`` (MACE registers one for the CPU with quantization on,
mace/ops/pad.cc: CONSTANT mode, NHWC ``paddings``, output scale and zero point = the input's; the
Hexagon converter makes it QuantizedPad_8) followed by the same op with ``padding_values`` [0, 0].
The fill is the real 0 (the zero point) for a convolution and the input range's minimum (code 0)
for a max pooling. With no padding every window lies inside the input and every output is the
model's. The function is the same; the cost is one copy of the padded input per rewritten op
(counted in :class:`SafeFormCost`). An average pooling has no safe form (the pad would enter its
divisor): it stays, and is reported as a deviation.

Which ops to rewrite is decided by the runtime itself (``Model.deviations``) on the built
model, so the writer and the simulation cannot disagree; an op whose input range is found per
image (fed by the input Quantize) is judged for any multiplier.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.mace import mace_pb2
from maceq.mace.cost import net_macs, op_elements
from maceq.mace.enums import DataType, PoolingType
from maceq.mace.format import LoadedModel, add_arg, get_arg
from maceq.runtime.model import Model
from maceq.runtime.devices import Device, device_spec

PAD_SUFFIX = "__maceq_pad"


@dataclass(frozen=True)
class SafeForm:
    """One rewritten op: why, and what the rewrite adds."""

    op: str
    reason: str
    pad_op: str
    padded_shape: tuple[int, ...]  # NHWC, per image with the model's batch

    @property
    def added_bytes(self) -> int:
        """Bytes the Pad op writes per run (uint8 NHWC)."""
        return int(np.prod(self.padded_shape))


@dataclass(frozen=True)
class SafeFormCost:
    """What the rewrites cost, counted on the model: ops, MACs and bytes written per run."""

    ops_before: int
    ops_after: int
    macs: int
    activation_bytes_before: int
    pad_bytes: int

    @property
    def byte_increase(self) -> float:
        """Extra activation bytes written per run, as a fraction of what the model writes without them."""
        return self.pad_bytes / self.activation_bytes_before if self.activation_bytes_before else 0.0

    def describe(self) -> str:
        """One line for the CLI and the model's metadata."""
        return (f"+{self.ops_after - self.ops_before} Pad op(s) ({self.ops_before} -> {self.ops_after} ops), MACs "
                f"unchanged ({self.macs:,}), +{self.pad_bytes:,} bytes copied per run "
                f"(+{100 * self.byte_increase:.1f}% of the activation bytes the model writes)")


def _find_range_inputs(net) -> set[str]:
    """Tensors made by a Quantize op that finds its range on every run (the input's range is per image)."""
    return {op.output[0] for op in net.op
            if op.type == "Quantize" and int(get_arg(op, "find_range_every_time", 0) or 0)}


def find_defects(model: Model, device: Device) -> dict[str, str]:
    """Op name -> reason, for ops whose result on ``device`` departs from the model's meaning.

    Ops fed by a per-image input range are judged as if their multiplier allowed the fast path
    (below 0.5), since some image may give one.
    """
    per_image = _find_range_inputs(model.net_def)
    found = dict(model.deviations(device))
    for prepared in model.probe_ops(device_spec(device)):
        op, params = prepared.op, prepared.params
        if op.name in found or not op.inputs or op.inputs[0] not in per_image or not hasattr(params, "shift"):
            continue  # only a gemmlowp-requantized convolution's path depends on its multiplier
        forced = dataclasses.replace(params, shift=min(params.shift, -1))
        why = prepared.kernel.deviation(forced, [_shape_of(model, t) for t in op.inputs])
        if why:
            found[op.name] = why + " (for images whose input range gives a requantization multiplier below 0.5)"
    return found


def _shape_of(model: Model, tensor: str):
    """The shape of ``tensor`` in ``model`` (op output, const or input), or None."""
    for op in model.ops:
        if tensor in op.outputs:
            return op.output_shapes[op.outputs.index(tensor)]
    if tensor in model.consts:
        return tuple(model.consts[tensor].shape)
    info = model.input_info.get(tensor)
    return tuple(int(d) for d in info.dims) if info is not None else None


def _producer_qinfo(net, tensor: str):
    """The quantize_info of the op that produces ``tensor``, or None."""
    for op in net.op:
        if tensor in op.output and op.quantize_info:
            return op.quantize_info[list(op.output).index(tensor) if len(op.quantize_info) > 1 else 0]
    return None


def _pad_value(net, op) -> float:
    """The constant the explicit Pad fills with, in real units: 0 for a convolution (the zero point),
    the input range's minimum (code 0) for a max pooling, where a pad must never win the max."""
    if op.type != "Pooling":
        return 0.0
    qi = _producer_qinfo(net, op.input[0])
    return float(qi.minval) if qi is not None else 0.0


def has_safe_form(op) -> bool:
    """Whether an op has a safe form: a convolution, or a max pooling (an average pooling's divisor
    would count the explicit pad)."""
    return op.type in ("Conv2D", "DepthwiseConv2d") or (
        op.type == "Pooling" and int(get_arg(op, "pooling_type", 0) or 0) == PoolingType.MAX)


def _pad_op(net, op, in_shape) -> tuple[object, tuple[int, ...]]:
    """A uint8 CONSTANT Pad of the op's input by the op's own padding, and the padded shape."""
    ph, pw = (list(get_arg(op, "padding_values", [0, 0])) + [0, 0])[:2]
    top, left = ph >> 1, pw >> 1
    bottom, right = ph - top, pw - left
    n, h, w, c = in_shape
    padded = (n, h + top + bottom, w + left + right, c)
    pad = mace_pb2.OperatorDef()
    pad.name = op.name + PAD_SUFFIX
    pad.type = "Pad"
    pad.input.append(op.input[0])
    pad.output.append(op.input[0] + PAD_SUFFIX + "_" + op.name)
    add_arg(pad, "T", DataType.DT_UINT8)
    for a in op.arg:
        if a.name in ("framework_type", "data_format"):
            pad.arg.add().CopyFrom(a)
    add_arg(pad, "paddings", [0, 0, top, bottom, left, right, 0, 0])
    add_arg(pad, "pad_type", 0)
    add_arg(pad, "constant_value", _pad_value(net, op))
    pad.output_shape.add().dims.extend(padded)
    qi = _producer_qinfo(net, op.input[0])
    if qi is not None:
        pad.quantize_info.add().CopyFrom(qi)
    return pad, padded


def apply_safe_forms(net, defects: dict[str, str], shape_of) -> list[SafeForm]:
    """Rewrite each op named in ``defects`` in ``net`` (in place): Pad, then the op with no padding.

    ``shape_of(tensor)`` gives an op input's NHWC shape.
    """
    ops = list(net.op)
    out, done = [], []
    for op in ops:
        if op.name in defects:
            if not has_safe_form(op):
                raise MaceqError(f"op '{op.name}' ({op.type}): no safe form is known for this op")
            in_shape = shape_of(op.input[0])
            if in_shape is None or len(in_shape) != 4:
                raise MaceqError(f"op '{op.name}': the shape of its input '{op.input[0]}' is unknown")
            pad, padded = _pad_op(net, op, in_shape)
            new = mace_pb2.OperatorDef()
            new.CopyFrom(op)
            new.input[0] = pad.output[0]
            for a in new.arg:
                if a.name == "padding_values":
                    del a.ints[:]
                    a.ints.extend([0, 0])
            out += [pad, new]
            done.append(SafeForm(op.name, defects[op.name], pad.name, padded))
        else:
            c = mace_pb2.OperatorDef()
            c.CopyFrom(op)
            out.append(c)
    del net.op[:]
    net.op.extend(out)
    return done


def in_memory_model(multi_net_def, arrays, device: Device) -> Model:
    """A runtime Model over a built (not yet written) MultiNetDef."""
    net = multi_net_def.net_def[0]
    return Model(LoadedModel(net, dict(arrays), {"maceq": {"device": Device.parse(device).value}}, None, multi_net_def))


def cost(before: list, after: list, arrays, forms: list[SafeForm]) -> SafeFormCost:
    """Ops, MACs and activation bytes written per run, before the rewrites, and what they add."""
    act = sum(op_elements(op) for op in before if op.type != "Dequantize")
    if net_macs(before, arrays) != net_macs(after, arrays):
        raise MaceqError("safe forms: the rewrite changed the number of MACs")
    return SafeFormCost(len(before), len(after), net_macs(before, arrays), act, sum(f.added_bytes for f in forms))


def make_safe(built, device: Device, defects: dict[str, str] | None = None
              ) -> tuple[list[SafeForm], SafeFormCost | None, dict[str, str]]:
    """Find (unless given) and rewrite the ops of a BuiltModel that ``device`` computes wrongly; checks the result.

    Returns the rewrites, their cost (None when nothing was rewritten) and the deviations no safe
    form covers (op name -> reason: an average pooling), which the model keeps and the caller reports.
    """
    model = in_memory_model(built.multi_net_def, built.arrays, device)
    if defects is None:
        defects = find_defects(model, device)
    net = built.multi_net_def.net_def[0]
    ops = {op.name: op for op in net.op}
    kept = {n: why for n, why in defects.items() if not has_safe_form(ops[n])}
    todo = {n: why for n, why in defects.items() if n not in kept}
    if not todo:
        return [], None, kept
    before = [mace_pb2.OperatorDef.FromString(op.SerializeToString()) for op in net.op]
    forms = apply_safe_forms(net, todo, lambda t: _shape_of(model, t))
    left = {n: why for n, why in find_defects(in_memory_model(built.multi_net_def, built.arrays, device),
                                              device).items() if n not in kept}
    if left:
        name, why = next(iter(left.items()))
        raise MaceqError(f"op '{name}': still computed differently from the model after the rewrite ({why})")
    return forms, cost(before, list(net.op), built.arrays, forms), kept
