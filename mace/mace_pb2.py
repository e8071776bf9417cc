"""Python classes for the MACE schema (mace.proto), built without protoc.

The descriptor is assembled at import time from the tables below, which mirror
``mace.proto`` (same package ``mace``, same message, field and enum names,
numbers, types, labels, defaults and ``packed`` options). No generated code is
involved, so any protobuf >= 4.21 works (upb, cpp or pure-python backend).
``tests/test_mace_format.py`` parses ``mace.proto`` and checks that the two
agree field by field.

The classes live in a private :class:`DescriptorPool`, so they never clash with
another ``mace.proto`` (MACE's own ``py_proto``) registered in the default pool.

Usage mirrors protoc's gencode::

    from maceq.mace import mace_pb2
    net = mace_pb2.NetDef()
    t = net.tensors.add(); t.data_type = mace_pb2.DT_UINT8
"""
from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import enum_type_wrapper

_F = descriptor_pb2.FieldDescriptorProto

# (name, [(value_name, number), ...])
_ENUMS: list[tuple[str, list[tuple[str, int]]]] = [
    ("DataType", [
        ("DT_INVALID", 0), ("DT_FLOAT", 1), ("DT_UINT8", 2), ("DT_HALF", 3),
        ("DT_INT32", 4), ("DT_FLOAT16", 5), ("DT_BFLOAT16", 6), ("DT_INT16", 7),
        ("DT_INT8", 8),
    ]),
    ("MemoryType", [
        ("CPU_BUFFER", 0), ("GPU_BUFFER", 1), ("GPU_IMAGE", 2), ("MEMORY_NONE", 10000),
    ]),
]

# Field spec: (label, type, name, number, extra) where type is a scalar proto
# type name or a message/enum name of this package, and extra may hold
# "default" (the text form, as in .proto) and "packed" (bool).
_MESSAGES: list[tuple[str, list[tuple]]] = [
    ("ConstTensor", [
        ("repeated", "int64", "dims", 1, {}),
        ("optional", "DataType", "data_type", 2, {"default": "DT_FLOAT"}),
        ("repeated", "float", "float_data", 3, {"packed": True}),
        ("repeated", "int32", "int32_data", 4, {"packed": True}),
        ("optional", "string", "name", 5, {}),
        ("optional", "int64", "offset", 6, {}),
        ("optional", "int64", "data_size", 7, {}),
        ("optional", "float", "scale", 8, {}),
        ("optional", "int32", "zero_point", 9, {}),
        ("optional", "float", "minval", 10, {}),
        ("optional", "float", "maxval", 11, {}),
        ("optional", "bool", "quantized", 12, {"default": "false"}),
        ("optional", "uint32", "node_id", 100, {}),
    ]),
    ("Argument", [
        ("optional", "string", "name", 1, {}),
        ("optional", "float", "f", 2, {}),
        ("optional", "int64", "i", 3, {}),
        ("optional", "bytes", "s", 4, {}),
        ("repeated", "float", "floats", 5, {}),
        ("repeated", "int64", "ints", 6, {}),
    ]),
    ("NodeInput", [
        ("optional", "int32", "node_id", 1, {}),
        ("optional", "int32", "output_port", 2, {}),
    ]),
    ("OutputShape", [
        ("repeated", "int64", "dims", 1, {}),
    ]),
    ("QuantizeActivationInfo", [
        ("optional", "float", "scale", 1, {}),
        ("optional", "int32", "zero_point", 2, {}),
        ("optional", "float", "minval", 3, {}),
        ("optional", "float", "maxval", 4, {}),
    ]),
    ("OperatorDef", [
        ("repeated", "string", "input", 1, {}),
        ("repeated", "string", "output", 2, {}),
        ("optional", "string", "name", 3, {}),
        ("optional", "string", "type", 4, {}),
        ("optional", "int32", "device_type", 5, {}),
        ("repeated", "Argument", "arg", 6, {}),
        ("repeated", "OutputShape", "output_shape", 7, {}),
        ("repeated", "DataType", "output_type", 8, {}),
        ("repeated", "QuantizeActivationInfo", "quantize_info", 9, {}),
        ("repeated", "int32", "mem_id", 10, {}),
        ("optional", "uint32", "node_id", 100, {}),
        ("optional", "uint32", "op_id", 101, {}),
        ("optional", "uint32", "padding", 102, {}),
        ("repeated", "NodeInput", "node_input", 103, {}),
        ("repeated", "int32", "out_max_byte_size", 104, {}),
    ]),
    ("InputOutputInfo", [
        ("optional", "string", "name", 1, {}),
        ("optional", "int32", "node_id", 2, {}),
        ("repeated", "int32", "dims", 3, {}),
        ("optional", "int32", "max_byte_size", 4, {}),
        ("optional", "DataType", "data_type", 5, {"default": "DT_FLOAT"}),
        ("optional", "int32", "data_format", 6, {"default": "1"}),
        ("optional", "float", "scale", 7, {}),
        ("optional", "int32", "zero_point", 8, {}),
        ("optional", "string", "alias", 100, {}),
    ]),
    ("NetDef", [
        ("repeated", "OperatorDef", "op", 1, {}),
        ("repeated", "Argument", "arg", 2, {}),
        ("repeated", "ConstTensor", "tensors", 3, {}),
        ("optional", "DataType", "data_type", 4, {"default": "DT_FLOAT"}),
        ("optional", "string", "name", 5, {}),
        ("optional", "int64", "data_offset", 6, {}),
        ("optional", "int64", "data_size", 7, {}),
        ("optional", "int32", "infer_order", 8, {}),
        ("repeated", "InputOutputInfo", "input_info", 100, {}),
        ("repeated", "InputOutputInfo", "output_info", 101, {}),
    ]),
    ("MultiNetDef", [
        ("repeated", "NetDef", "net_def", 3, {}),
        ("repeated", "string", "input_tensor", 100, {}),
        ("repeated", "string", "output_tensor", 101, {}),
    ]),
]

_SCALAR_TYPES = {
    "double": _F.TYPE_DOUBLE, "float": _F.TYPE_FLOAT, "int64": _F.TYPE_INT64,
    "uint64": _F.TYPE_UINT64, "int32": _F.TYPE_INT32, "uint32": _F.TYPE_UINT32,
    "bool": _F.TYPE_BOOL, "string": _F.TYPE_STRING, "bytes": _F.TYPE_BYTES,
    "sint32": _F.TYPE_SINT32, "sint64": _F.TYPE_SINT64,
    "fixed32": _F.TYPE_FIXED32, "fixed64": _F.TYPE_FIXED64,
}
_LABELS = {"optional": _F.LABEL_OPTIONAL, "repeated": _F.LABEL_REPEATED,
           "required": _F.LABEL_REQUIRED}

PACKAGE = "mace"
FILE_NAME = "maceq/mace/mace.proto"


def build_file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto that protoc would produce for mace.proto."""
    fdp = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto2")
    fdp.options.optimize_for = descriptor_pb2.FileOptions.LITE_RUNTIME
    enum_names = {name for name, _ in _ENUMS}
    message_names = {name for name, _ in _MESSAGES}
    for name, values in _ENUMS:
        e = fdp.enum_type.add(name=name)
        for vname, number in values:
            e.value.add(name=vname, number=number)
    for name, fields in _MESSAGES:
        m = fdp.message_type.add(name=name)
        for label, ftype, fname, number, extra in fields:
            f = m.field.add(name=fname, number=number, label=_LABELS[label])
            if ftype in _SCALAR_TYPES:
                f.type = _SCALAR_TYPES[ftype]
            elif ftype in enum_names:
                f.type = _F.TYPE_ENUM
                f.type_name = f".{PACKAGE}.{ftype}"
            elif ftype in message_names:
                f.type = _F.TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{ftype}"
            else:  # pragma: no cover - a typo in the tables above
                raise ValueError(f"mace_pb2: unknown type {ftype!r} for {name}.{fname}")
            if "default" in extra:
                f.default_value = extra["default"]
            if extra.get("packed"):
                f.options.packed = True
    return fdp


_POOL = descriptor_pool.DescriptorPool()
_POOL.AddSerializedFile(build_file_descriptor_proto().SerializeToString())
DESCRIPTOR = _POOL.FindFileByName(FILE_NAME)


def _message_class(full_name: str):
    desc = _POOL.FindMessageTypeByName(full_name)
    get = getattr(message_factory, "GetMessageClass", None)
    if get is not None:  # protobuf >= 4.22
        return get(desc)
    return message_factory.MessageFactory(_POOL).GetPrototype(desc)  # protobuf 4.21


DataType = enum_type_wrapper.EnumTypeWrapper(_POOL.FindEnumTypeByName("mace.DataType"))
MemoryType = enum_type_wrapper.EnumTypeWrapper(_POOL.FindEnumTypeByName("mace.MemoryType"))
for _enum in (DataType, MemoryType):
    for _vname, _number in _enum.items():
        globals()[_vname] = _number

ConstTensor = _message_class("mace.ConstTensor")
Argument = _message_class("mace.Argument")
NodeInput = _message_class("mace.NodeInput")
OutputShape = _message_class("mace.OutputShape")
QuantizeActivationInfo = _message_class("mace.QuantizeActivationInfo")
OperatorDef = _message_class("mace.OperatorDef")
InputOutputInfo = _message_class("mace.InputOutputInfo")
NetDef = _message_class("mace.NetDef")
MultiNetDef = _message_class("mace.MultiNetDef")

__all__ = [
    "DESCRIPTOR", "DataType", "MemoryType", "ConstTensor", "Argument", "NodeInput",
    "OutputShape", "QuantizeActivationInfo", "OperatorDef", "InputOutputInfo", "NetDef",
    "MultiNetDef", "build_file_descriptor_proto",
] + [v for e in (DataType, MemoryType) for v in e.keys()]
