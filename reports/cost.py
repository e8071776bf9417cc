"""How much of a quantized model runs in float, and how often tensors change hands.

Float ops are the model's ops with ``T = DT_FLOAT`` (mixed precision, or ops without a uint8 kernel);
every Quantize/Dequantize between them and the uint8 ops is a boundary. Two shares are counted: of
the multiply-accumulates (convolutions, matrix products), and of the activation values the ops
write, where float ops and boundary conversions count (elementwise float work such as SiLU or
HardSwish does no MACs but is memory-bound: this share weighs it). On the dsp device, ops nnlib
lacks or rejects run on the CPU: each tensor that crosses between the two processors is a transfer.
"""
from __future__ import annotations

from dataclasses import dataclass

from maceq.mace.cost import is_float, op_elements, op_macs
from maceq.runtime.devices import Device, device_spec
from maceq.runtime.model import Model

#: above this share of the MACs, or of the activation values written, in float, quantize warns
FLOAT_SHARE_WARNING = 1 / 3


@dataclass(frozen=True)
class FloatShare:
    device: Device
    ops: int
    float_ops: int
    macs: int
    float_macs: int
    boundaries: int  # Quantize/Dequantize ops inside the graph (the input's and the outputs' not counted)
    transfers: int  # tensors crossing between the device's processor and its fallback (dsp <-> cpu)
    fallback_ops: int  # ops that run on the fallback processor
    values: int = 0  # activation values all ops write per run
    float_values: int = 0  # those written by float ops and by the boundaries' conversions
    boundary_values: int = 0  # values the inner Quantize/Dequantize ops convert per run

    @property
    def float_mac_share(self) -> float:
        return self.float_macs / self.macs if self.macs else 0.0

    @property
    def float_value_share(self) -> float:
        return self.float_values / self.values if self.values else 0.0

    def describe(self) -> str:
        """One line: the float share of ops and MACs, the boundaries, and the fallback traffic."""
        line = (f"{self.float_ops} of {self.ops} compute ops in float32 ({100 * self.float_mac_share:.1f}% of "
                f"{self.macs:,} MACs, {100 * self.float_value_share:.1f}% of the activation values written), "
                f"{self.boundaries} float<->uint8 boundaries")
        fallback = device_spec(self.device).fallback
        if fallback is not None:
            line += (f", {self.fallback_ops} ops on the {fallback.value} fallback with {self.transfers} "
                     f"{self.device.value}<->{fallback.value} transfers per run")
        return line

    @property
    def warning(self) -> str | None:
        if self.float_mac_share > FLOAT_SHARE_WARNING:
            what = f"{100 * self.float_mac_share:.0f}% of the MACs run"
        elif self.float_value_share > FLOAT_SHARE_WARNING:
            what = (f"{100 * self.float_value_share:.0f}% of the activation values are computed or converted "
                    f"({self.float_ops} float ops, {self.boundaries} boundaries)")
        else:
            return None
        return (f"warning: {what} in float32 on {self.device.value}: the int8 model will be slow there; "
                f"see which ops with `maceq inspect`")


def float_share(model: Model, device: "Device | str") -> FloatShare:
    """The float share of ``model`` on ``device`` (one probe run when the device has a fallback)."""
    device = Device.parse(device)
    ops = list(model.net_def.op)
    inputs, outputs = set(model.input_names), set(model.output_names)
    compute = [op for op in ops if op.type not in ("Quantize", "Dequantize")]
    transfers = fallback_ops = 0
    if device_spec(device).fallback is not None:
        placement = model.placement(device)
        transfers = model.boundary_transfers(placement)
        fallback_ops = sum(1 for where, _ in placement.values() if where != device.value)
    converted = [op for op in ops if (op.type == "Quantize" and op.input[0] not in inputs)
                 or (op.type == "Dequantize" and op.output[0] not in outputs)]
    return FloatShare(device, len(compute), sum(1 for op in compute if is_float(op)),
                      sum(op_macs(op, model.consts) for op in ops),
                      sum(op_macs(op, model.consts) for op in ops if is_float(op)),
                      len(converted), transfers, fallback_ops,
                      sum(op_elements(op) for op in ops),
                      sum(op_elements(op) for op in compute if is_float(op)) + sum(op_elements(op) for op in converted),
                      sum(op_elements(op) for op in converted))
