"""Build single-op quantized .tflite models in pure Python and run them on TFLite's reference kernels.

The oracle for maceq's integer kernels (docs/oracle-notes.md): models are
written with the ``tflite`` package's generated flatbuffer builder functions
plus ``flatbuffers`` (no TensorFlow), and run by
``ai_edge_litert.interpreter.Interpreter`` with ``OpResolverType.BUILTIN_REF``.
The other resolvers are optimized kernels that differ from the reference by
+-1 on a fraction of elements; never use them as the oracle.

Usage::

    x = TensorSpec((1, 8, 8, 3), 0.02, 128)
    w = TensorSpec((4, 3, 3, 3), 0.005, 120, data=w_u8)
    b = TensorSpec((4,), 0.02 * 0.005, 0, dtype="int32", data=b_i32)
    y = TensorSpec((1, 8, 8, 4), 0.05, 100)
    model = build_single_op_model("CONV_2D", [x, w, b], [y],
                                  options={"padding": "SAME", "stride_h": 1, "stride_w": 1})
    (out,) = run_ref(model, [x_u8])

Inputs with ``data`` set become constant buffers; the others are graph inputs
fed, in order, by ``run_ref``. Scales are stored as float32 (what TFLite reads);
``scale=None`` makes an unquantized tensor (e.g. MEAN's int32 axis). Options are
the op's builtin options by flatbuffer field name; string values name enum
members (padding, fused_activation_function, weights_format), lists become
vectors (e.g. RESHAPE's new_shape). An absent input (optional bias) can be
given as ``None`` and is encoded as tensor index -1.

TFLite padding is SAME or VALID only. To test explicit (asymmetric) pads,
pre-pad the input in numpy with its zero point and use VALID: the reference
kernels skip out-of-image taps, which equals adding (x_zp - x_zp) = 0, so the
two are the same computation (tests/oracle/test_conv_oracle.py does this).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import flatbuffers
import numpy as np
import tflite

__all__ = ["TensorSpec", "build_single_op_model", "run_ref", "fused_activation_range"]


@dataclass
class TensorSpec:
    """One tensor of a single-op model: shape, quantization, dtype and optional constant data."""

    shape: tuple
    scale: float | list[float] | None
    zero_point: int | list[int] | None
    dtype: str = "uint8"
    data: np.ndarray | None = None
    quantized_dimension: int = 0


_DTYPES = {
    "uint8": (tflite.TensorType.UINT8, np.uint8),
    "int8": (tflite.TensorType.INT8, np.int8),
    "int16": (tflite.TensorType.INT16, np.int16),
    "int32": (tflite.TensorType.INT32, np.int32),
    "int64": (tflite.TensorType.INT64, np.int64),
    "float32": (tflite.TensorType.FLOAT32, np.float32),
}

# BuiltinOperator name -> builtin options table (None: the op has no options).
_OPTIONS_TABLE = {
    "CONV_2D": "Conv2DOptions",
    "DEPTHWISE_CONV_2D": "DepthwiseConv2DOptions",
    "FULLY_CONNECTED": "FullyConnectedOptions",
    "ADD": "AddOptions",
    "SUB": "SubOptions",
    "MUL": "MulOptions",
    "AVERAGE_POOL_2D": "Pool2DOptions",
    "MAX_POOL_2D": "Pool2DOptions",
    "CONCATENATION": "ConcatenationOptions",
    "SOFTMAX": "SoftmaxOptions",
    "MEAN": "ReducerOptions",
    "SUM": "ReducerOptions",
    "RESHAPE": "ReshapeOptions",
    "QUANTIZE": "QuantizeOptions",
    "DEQUANTIZE": "DequantizeOptions",
    "PAD": "PadOptions",
    "RESIZE_BILINEAR": "ResizeBilinearOptions",
    "RESIZE_NEAREST_NEIGHBOR": "ResizeNearestNeighborOptions",
    "TRANSPOSE": "TransposeOptions",
    "MAXIMUM": "MaximumMinimumOptions",
    "MINIMUM": "MaximumMinimumOptions",
    "LEAKY_RELU": "LeakyReluOptions",
    "HARD_SWISH": "HardSwishOptions",
    "RELU": None,
    "RELU6": None,
    "LOGISTIC": None,
    "TANH": None,
}

# Option fields whose string values are enum members.
_ENUM_FIELDS = {
    "padding": tflite.Padding,
    "fused_activation_function": tflite.ActivationFunctionType,
    "weights_format": tflite.FullyConnectedOptionsWeightsFormat,
}


def _camel(field: str) -> str:
    return "".join(p[:1].upper() + p[1:] for p in field.split("_"))


def _aligned_bytes(builder: flatbuffers.Builder, payload: bytes) -> int:
    """A [ubyte] vector aligned to 16 bytes (so int32/float32 constants are aligned)."""
    builder.StartVector(1, len(payload), 16)
    builder.head = builder.head - len(payload)
    builder.Bytes[builder.head:builder.head + len(payload)] = payload
    builder.vectorNumElems = len(payload)
    return builder.EndVector()


def _int_vector(builder: flatbuffers.Builder, values, dtype=np.int32) -> int:
    return builder.CreateNumpyVector(np.asarray(values, dtype=dtype).reshape(-1))


def _build_options(builder: flatbuffers.Builder, op: str, options: dict | None):
    """(BuiltinOptions type, table offset) for ``op``; (0, None) when the op has none."""
    if op not in _OPTIONS_TABLE:
        raise ValueError(f"tflite_builder: unsupported op {op!r}; add it to _OPTIONS_TABLE")
    table = _OPTIONS_TABLE[op]
    if table is None:
        if options:
            raise ValueError(f"tflite_builder: {op} takes no options, got {sorted(options)}")
        return 0, None
    mod = importlib.import_module(f"tflite.{table}")
    options = dict(options or {})
    # Vectors must be finished before the table starts.
    vectors = {}
    for key, val in options.items():
        if isinstance(val, (list, tuple, np.ndarray)):
            vectors[key] = _int_vector(builder, val)
    getattr(mod, "Start")(builder)
    for key, val in options.items():
        adder = getattr(mod, "Add" + _camel(key), None)
        if adder is None:
            raise ValueError(f"tflite_builder: {table} has no field {key!r}")
        if key in vectors:
            val = vectors[key]
        elif isinstance(val, str):
            enum = _ENUM_FIELDS.get(key)
            if enum is None or not hasattr(enum, val):
                raise ValueError(f"tflite_builder: bad value {val!r} for {table}.{key}")
            val = getattr(enum, val)
        elif isinstance(val, (bool, np.bool_)):
            val = bool(val)
        adder(builder, val)
    return getattr(tflite.BuiltinOptions, table), getattr(mod, "End")(builder)


def _build_quantization(builder: flatbuffers.Builder, spec: TensorSpec):
    if spec.scale is None:
        return None
    scales = np.atleast_1d(np.asarray(spec.scale, dtype=np.float32))
    zps = np.atleast_1d(np.asarray(spec.zero_point if spec.zero_point is not None else 0, dtype=np.int64))
    if zps.size == 1 and scales.size > 1:
        zps = np.repeat(zps, scales.size)
    scale_vec = builder.CreateNumpyVector(scales)
    zp_vec = builder.CreateNumpyVector(zps)
    tflite.QuantizationParametersStart(builder)
    tflite.QuantizationParametersAddScale(builder, scale_vec)
    tflite.QuantizationParametersAddZeroPoint(builder, zp_vec)
    tflite.QuantizationParametersAddQuantizedDimension(builder, int(spec.quantized_dimension))
    return tflite.QuantizationParametersEnd(builder)


def build_single_op_model(op: str, inputs: list[TensorSpec | None], outputs: list[TensorSpec], *,
                          options: dict | None = None) -> bytes:
    """Contract: a serialized TFLite model holding one ``op`` (BuiltinOperator name) and its tensors."""
    code = getattr(tflite.BuiltinOperator, op, None)
    if code is None:
        raise ValueError(f"tflite_builder: unknown BuiltinOperator {op!r}")
    builder = flatbuffers.Builder(1024)
    specs: list[TensorSpec] = [s for s in inputs if s is not None] + list(outputs)
    buffer_payloads, tensor_buffer = _payloads(specs)
    tensor_offsets = [_tensor(builder, i, spec, tensor_buffer[i]) for i, spec in enumerate(specs)]

    # Operator inputs in the caller's order; an absent (None) input is -1.
    op_inputs, graph_inputs, k = [], [], 0
    for s in inputs:
        if s is None:
            op_inputs.append(-1)
            continue
        op_inputs.append(k)
        if s.data is None:
            graph_inputs.append(k)
        k += 1
    op_outputs = list(range(k, k + len(outputs)))
    operator = _operator(builder, op, options, op_inputs, op_outputs)
    subgraph = _subgraph(builder, tensor_offsets, graph_inputs, op_outputs, operator)

    tflite.OperatorCodeStart(builder)
    tflite.OperatorCodeAddDeprecatedBuiltinCode(builder, min(code, 127))
    tflite.OperatorCodeAddBuiltinCode(builder, code)
    tflite.OperatorCodeAddVersion(builder, 1)
    opcode = tflite.OperatorCodeEnd(builder)

    buffer_offsets = []
    for payload in buffer_payloads:
        data = _aligned_bytes(builder, payload) if payload else None
        tflite.BufferStart(builder)
        if data is not None:
            tflite.BufferAddData(builder, data)
        buffer_offsets.append(tflite.BufferEnd(builder))
    return _finish_model(builder, opcode, subgraph, buffer_offsets)


def _payloads(specs: list[TensorSpec]) -> tuple[list[bytes], list[int]]:
    """(the buffers' bytes, each tensor's buffer index): buffer 0 is the empty sentinel; each constant gets its own."""
    buffer_payloads: list[bytes] = [b""]
    tensor_buffer: list[int] = []
    for spec in specs:
        if spec.data is not None:
            np_dtype = _DTYPES[spec.dtype][1]
            arr = np.asarray(spec.data)
            if tuple(arr.shape) != tuple(spec.shape):
                raise ValueError(f"tflite_builder: data shape {arr.shape} != spec shape {spec.shape}")
            buffer_payloads.append(np.ascontiguousarray(arr.astype(np_dtype)).astype(
                np.dtype(np_dtype).newbyteorder("<")).tobytes())
            tensor_buffer.append(len(buffer_payloads) - 1)
        else:
            tensor_buffer.append(0)
    return buffer_payloads, tensor_buffer


def _tensor(builder, i: int, spec: TensorSpec, buffer: int):
    """Tensor ``t{i}`` of ``spec`` on ``buffer``."""
    name = builder.CreateString(f"t{i}")
    shape = _int_vector(builder, spec.shape)
    quant = _build_quantization(builder, spec)
    tflite.TensorStart(builder)
    tflite.TensorAddShape(builder, shape)
    tflite.TensorAddType(builder, _DTYPES[spec.dtype][0])
    tflite.TensorAddBuffer(builder, buffer)
    tflite.TensorAddName(builder, name)
    if quant is not None:
        tflite.TensorAddQuantization(builder, quant)
    return tflite.TensorEnd(builder)


def _operator(builder, op: str, options: dict | None, op_inputs: list[int], op_outputs: list[int]):
    """The one operator (opcode 0) with its builtin options."""
    opt_type, opt_offset = _build_options(builder, op, options)
    op_in_vec = _int_vector(builder, op_inputs)
    op_out_vec = _int_vector(builder, op_outputs)
    tflite.OperatorStart(builder)
    tflite.OperatorAddOpcodeIndex(builder, 0)
    tflite.OperatorAddInputs(builder, op_in_vec)
    tflite.OperatorAddOutputs(builder, op_out_vec)
    if opt_offset is not None:
        tflite.OperatorAddBuiltinOptionsType(builder, opt_type)
        tflite.OperatorAddBuiltinOptions(builder, opt_offset)
    return tflite.OperatorEnd(builder)


def _subgraph(builder, tensor_offsets: list, graph_inputs: list[int], op_outputs: list[int], operator):
    """The main subgraph: the tensors, the graph inputs and outputs, the one operator."""
    tflite.SubGraphStartTensorsVector(builder, len(tensor_offsets))
    for t in reversed(tensor_offsets):
        builder.PrependUOffsetTRelative(t)
    tensors_vec = builder.EndVector()
    sg_in = _int_vector(builder, graph_inputs)
    sg_out = _int_vector(builder, op_outputs)
    tflite.SubGraphStartOperatorsVector(builder, 1)
    builder.PrependUOffsetTRelative(operator)
    ops_vec = builder.EndVector()
    sg_name = builder.CreateString("main")
    tflite.SubGraphStart(builder)
    tflite.SubGraphAddTensors(builder, tensors_vec)
    tflite.SubGraphAddInputs(builder, sg_in)
    tflite.SubGraphAddOutputs(builder, sg_out)
    tflite.SubGraphAddOperators(builder, ops_vec)
    tflite.SubGraphAddName(builder, sg_name)
    return tflite.SubGraphEnd(builder)


def _finish_model(builder, opcode, subgraph, buffer_offsets: list) -> bytes:
    """The model table around one opcode, one subgraph and the buffers, serialized."""
    tflite.ModelStartOperatorCodesVector(builder, 1)
    builder.PrependUOffsetTRelative(opcode)
    opcodes_vec = builder.EndVector()
    tflite.ModelStartSubgraphsVector(builder, 1)
    builder.PrependUOffsetTRelative(subgraph)
    subgraphs_vec = builder.EndVector()
    tflite.ModelStartBuffersVector(builder, len(buffer_offsets))
    for b in reversed(buffer_offsets):
        builder.PrependUOffsetTRelative(b)
    buffers_vec = builder.EndVector()
    description = builder.CreateString("maceq single-op oracle model")
    tflite.ModelStart(builder)
    tflite.ModelAddVersion(builder, 3)
    tflite.ModelAddOperatorCodes(builder, opcodes_vec)
    tflite.ModelAddSubgraphs(builder, subgraphs_vec)
    tflite.ModelAddDescription(builder, description)
    tflite.ModelAddBuffers(builder, buffers_vec)
    model = tflite.ModelEnd(builder)
    builder.Finish(model, file_identifier=b"TFL3")
    return bytes(builder.Output())


def run_ref(model: bytes, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Contract: run ``model`` once on TFLite's BUILTIN_REF kernels; returns copies of all outputs."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interp = Interpreter(model_content=model,
                         experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    details = interp.get_input_details()
    if len(details) != len(inputs):
        raise ValueError(f"run_ref: model has {len(details)} inputs, got {len(inputs)}")
    for d, x in zip(details, inputs):
        x = np.asarray(x)
        if tuple(d["shape"]) != x.shape:
            interp.resize_tensor_input(d["index"], x.shape)
    interp.allocate_tensors()
    for d, x in zip(details, inputs):
        interp.set_tensor(d["index"], np.asarray(x, dtype=d["dtype"]))
    interp.invoke()
    return [interp.get_tensor(d["index"]).copy() for d in interp.get_output_details()]


def fused_activation_range(activation: str, scale: float, zero_point: int,
                           dtype: str = "uint8") -> tuple[int, int]:
    """Contract: TFLite's quantized clamp for a fused activation (kernel_util.cc).

    CalculateActivationRangeQuantizedImpl: ``quantize(f) = zp +
    int(TfLiteRound(f / scale))`` with a float32 division and round half away
    from zero; RELU -> [max(qmin, quantize(0)), qmax]; RELU6 -> also
    min(qmax, quantize(6)); RELU_N1_TO_1 -> [max(qmin, quantize(-1)),
    min(qmax, quantize(1))]; NONE -> [qmin, qmax].
    """
    info = np.iinfo(_DTYPES[dtype][1])
    qmin, qmax = int(info.min), int(info.max)
    s = np.float32(scale)

    def quantize(f: float) -> int:
        v = np.float32(np.float32(f) / s)
        t = np.trunc(v)
        return int(zero_point) + int(t) + (int(np.sign(v)) if abs(v - t) >= 0.5 else 0)

    if activation == "NONE":
        return qmin, qmax
    if activation == "RELU":
        return max(qmin, quantize(0.0)), qmax
    if activation == "RELU6":
        return max(qmin, quantize(0.0)), min(qmax, quantize(6.0))
    if activation == "RELU_N1_TO_1":
        return max(qmin, quantize(-1.0)), min(qmax, quantize(1.0))
    raise ValueError(f"fused_activation_range: unknown activation {activation!r}")
