"""Devices: one frozen :class:`DeviceSpec` per :class:`Device` holds everything about a device.

- the runtime's arithmetic rules (rounding, requantization, range handling), which kernels read from
  the spec they are prepared for: nothing in a kernel tests which device it runs on;
- the converter's quantization scheme (:class:`WeightScheme`, implemented in quant/scheme.py);
- which ops the writer places in uint8 (``uint8_resize``) and where ops the device's own kernels lack
  run (``fallback``);
- the name of MACE's runtime in the deployment file.

Adding a device means adding a DeviceSpec and the kernel overrides it needs. The written spec of
each device's arithmetic is docs/semantics.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from maceq.errors import MaceqError
from maceq.runtime.kernels.dsp import SupernodeVariant


class Device(Enum):
    CPU = "cpu"
    GPU = "gpu"
    DSP = "dsp"

    @classmethod
    def parse(cls, value: "str | Device") -> "Device":
        if isinstance(value, Device):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise MaceqError(f"unknown device '{value}' (choose from {', '.join(d.value for d in cls)})") from None


class MultiplierRule(Enum):
    """How s_in * s_w / s_out is computed before QuantizeMultiplier."""

    FLOAT32 = "float32"  # MACE mace/core/quantize.h GetOutputMultiplierAndShift
    DOUBLE = "double"    # TFLite GetQuantizedConvolutionMultipler


class Requant(Enum):
    """How an int32 accumulator becomes a uint8 code."""

    GEMMLOWP = "gemmlowp"              # multiply_by_quantized_multiplier, + zp, clamp
    FLOAT32_ROUNDF = "float32_roundf"  # roundf(float(acc) * M + zp), clamp (MACE q8 gemv)
    FLOAT32_ROUND_THEN_ZP = "float32_round_then_zp"  # roundf(float(acc) * M) + zp, clamp (MACE DepthwiseConv2dGeneral)
    FLOAT32_RTE = "float32_rte"  # convert_uchar_sat_rte(f32(acc) * scale_c + zp), no FMA (gpu OpenCL kernels)


class FloatStorage(Enum):
    """How float tensors between float ops are stored."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"  # MACE's GPU fp16_fp32 mode: compute in float32, store half


class WeightScheme(Enum):
    """The converter's rules for weights, biases and activation ranges (quant/scheme.py)."""

    #: MACE's CPU converter: uint8 asymmetric per-tensor weights in [1, 255], int32 bias at s_in*s_w
    MACE_CPU = "mace_cpu"
    #: int8 symmetric per-output-channel weights, int32 bias per channel (the OpenCL int8 kernels)
    INT8_PER_CHANNEL = "int8_per_channel"
    #: MACE's HEXAGON converter: adjust_range_for_hexagon, bias symmetric over 2^32 levels
    MACE_HEXAGON = "mace_hexagon"


class InputQuantize(Enum):
    """How the input Quantize op maps float to uint8."""

    NEON_TRUNC = "neon_trunc"  # trunc(zp + 0.5 + x * (1/s)), float32 steps (MACE quantize.h, NEON)
    FLOAT32_RTE = "float32_rte"  # sat_rte(x * f32(1/s) + zp), float32 steps (gpu quantize_f32 kernel)


@dataclass(frozen=True)
class DeviceSpec:
    device: Device
    description: str
    #: the converter's quantization scheme for this device
    scheme: WeightScheme
    #: the deployment file's ``runtime`` key (MACE's name for the runtime)
    mace_runtime: str
    multiplier_rule: MultiplierRule
    conv_requant: Requant
    depthwise_requant: Requant
    #: DepthwiseConv2d with any dilation > 1 (MACE runs DepthwiseConv2dGeneral, a float path).
    dilated_depthwise_requant: Requant
    fc_requant: Requant
    #: Whether the FullyConnected bias goes through the bias-rescale rule (MACE's gemv adds it raw).
    fc_rescales_bias: bool
    input_quantize: InputQuantize
    #: Conv2D/DepthwiseConv2d rescale an int32 bias whose scale differs from s_in*s_w by more
    #: than 1e-6 (mace/ops/arm/q8/quantization_util.cc, see fixedpoint.mace_rescale_bias).
    conv_rescales_bias: bool
    #: The input Quantize op recomputes its range from every input tensor.
    find_range_every_time: bool
    #: Whether uint8 kernels apply the `activation`/`max_limit` args (MACE's do not).
    honours_activation_args: bool
    #: nnlib Supernode requantization (dsp only): D32 = the _d32 ops a Hexagon device runs (31-bit
    #: reciprocal and shift), REF = op_supernode.c's flat reference (16-bit reciprocal, ~7 bits).
    supernode_variant: SupernodeVariant | None = None
    #: How float tensors between float ops are stored.
    float_storage: FloatStorage = FloatStorage.FLOAT32
    #: uint8 DepthwiseConv2d takes TFLite's aarch64 3x3 fast path where ``Fast3x3FilterKernelSupported``
    #: holds, with its border outputs (runtime/kernels/dw3x3_arm.py). True where the op runs on MACE's
    #: ARM CPU runtime (the cpu device, and the dsp device's cpu fallback).
    depthwise_3x3_fast_path: bool = False
    #: float ops run MACE's NEON fp32 kernels (docs/float-neon.md); else the reference float kernels
    neon_float_kernels: bool = False
    #: a linear Resize can be written as a uint8 ResizeBilinear (the device has that integer kernel)
    uint8_resize: bool = True
    #: where ops run that the device's own kernels lack or reject (None: every op has a kernel here)
    fallback: Device | None = None


CPU = DeviceSpec(
    device=Device.CPU,
    scheme=WeightScheme.MACE_CPU,
    mace_runtime="cpu",
    description="MACE ARM CPU uint8 kernels (gemmlowp for Conv2D/DepthwiseConv2d, float gemv for FullyConnected)",
    multiplier_rule=MultiplierRule.FLOAT32,
    conv_requant=Requant.GEMMLOWP,
    depthwise_requant=Requant.GEMMLOWP,
    dilated_depthwise_requant=Requant.FLOAT32_ROUND_THEN_ZP,
    fc_requant=Requant.FLOAT32_ROUNDF,
    fc_rescales_bias=False,
    input_quantize=InputQuantize.NEON_TRUNC,
    conv_rescales_bias=True,
    find_range_every_time=True,
    honours_activation_args=False,
    depthwise_3x3_fast_path=True,
    neon_float_kernels=True,
)

GPU = DeviceSpec(
    device=Device.GPU,
    scheme=WeightScheme.INT8_PER_CHANNEL,
    mace_runtime="gpu",
    description="OpenCL int8 kernels (MNN-style): int8 symmetric per-channel weights, float32 RTE requantization, "
                "fp16_fp32 float path for ops without an integer kernel",
    multiplier_rule=MultiplierRule.FLOAT32,
    conv_requant=Requant.FLOAT32_RTE,
    depthwise_requant=Requant.FLOAT32_RTE,
    dilated_depthwise_requant=Requant.FLOAT32_RTE,
    fc_requant=Requant.FLOAT32_RTE,
    fc_rescales_bias=False,
    input_quantize=InputQuantize.FLOAT32_RTE,
    conv_rescales_bias=False,
    find_range_every_time=False,
    honours_activation_args=False,
    float_storage=FloatStorage.FLOAT16,
    uint8_resize=False,  # no integer resize kernel: it runs on the fp16_fp32 float path
)

DSP = DeviceSpec(
    device=Device.DSP,
    scheme=WeightScheme.MACE_HEXAGON,
    mace_runtime="dsp",
    description="Hexagon DSP through nnlib's reference ops (Supernode, DepthwiseSupernode, SuperFC, QuantizedAdd, "
                "QuantizedConcat, QuantizedMax/AvgPool); ops nnlib lacks or rejects run the cpu profile's kernels",
    multiplier_rule=MultiplierRule.FLOAT32,       # used only by ops that fall back to the cpu kernels
    conv_requant=Requant.GEMMLOWP,
    depthwise_requant=Requant.GEMMLOWP,
    dilated_depthwise_requant=Requant.FLOAT32_ROUND_THEN_ZP,
    fc_requant=Requant.FLOAT32_ROUNDF,
    fc_rescales_bias=False,
    input_quantize=InputQuantize.NEON_TRUNC,
    conv_rescales_bias=True,
    find_range_every_time=True,
    honours_activation_args=False,
    supernode_variant=SupernodeVariant.D32,
    depthwise_3x3_fast_path=True,
    fallback=Device.CPU,
)

SPECS: dict[Device, DeviceSpec] = {Device.CPU: CPU, Device.GPU: GPU, Device.DSP: DSP}


def device_spec(device: "str | Device") -> DeviceSpec:
    d = Device.parse(device)
    if d not in SPECS:
        raise MaceqError(f"device '{d.value}' has no spec yet (available: {', '.join(p.value for p in SPECS)})")
    return SPECS[d]
