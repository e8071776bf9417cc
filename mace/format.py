"""Write and read MACE models: ``.pb`` + ``.data`` + deployment ``.yml`` + range file.

The on-disk layout is the one MACE's converter writes (XiaoMi/mace
tools/python/convert.py ``convert`` and tools/python/utils/convert_util.py
``merge_params``):

* ``<name>.pb``: a serialized ``mace.MultiNetDef`` (older MACE: a bare ``NetDef``).
  Each ``ConstTensor`` carries no inline data; ``offset`` (bytes, relative to its
  ``NetDef.data_offset``) and ``data_size`` (elements) point into the ``.data`` file.
* ``<name>.data``: all constant tensors of a net, in ``net_def.tensors`` order,
  little-endian. Alignment rule (merge_params): before a tensor whose data type is
  not DT_UINT8, zero bytes pad the offset up to a multiple of 4; uint8 tensors are
  never padded. ``NetDef.data_offset`` is where the net's block starts in the file
  (the sum of the earlier nets' sizes, no padding between nets) and
  ``NetDef.data_size`` its length in bytes.
* ``<name>.yml``: MACE's deployment file, with sha256 checksums of ``.pb`` and
  ``.data``, and our own metadata under a top-level ``maceq:`` key.
* ``<name>_ranges.txt``: MACE's range file, one ``tensor@@min,max`` per line.

Writing a model (:func:`write_model`) is atomic as a set: all files are first
written and fsynced in a staging folder beside the target (``.<name>.staging-<pid>-*``,
hidden), then moved into place with ``os.replace`` in this order: the old ``.yml`` is
removed, the old ``.pb`` is removed, then ``.data``, ``.pb``, the range file and last
the ``.yml`` are renamed in. The ``.yml`` holds the sha256 of both ``.pb`` and
``.data``, so it is the commit record: a present ``.yml`` means the files next to it
are the complete set it names, and a process killed at any moment leaves either the
previous complete set, or no ``.yml`` (no model); a ``.pb`` never sits next to a
``.data`` of another write. The next write removes the staging folders of dead
processes. A model name is a plain file stem (:func:`check_model_name`), so nothing
is written outside the output folder.

Bad input raises :class:`maceq.errors.MaceqError` with a one-line message naming
the file (or tensor) at fault.
"""
from __future__ import annotations

import hashlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import yaml

from maceq.errors import MaceqError, one_line
from maceq.mace import mace_pb2
from maceq.yamlio import atomic_write

# ---------------------------------------------------------------------------
# Data types

#: Element type in the .data file for each ConstTensor.data_type (little-endian).
#: DT_BFLOAT16 is kept as its raw 16-bit pattern (uint16); MACE's converter writes
#: the top half of the float32 (tools/python/utils/convert_util.py Float2BFloat16Bytes).
_NP_DTYPE: dict[int, np.dtype] = {
    mace_pb2.DT_FLOAT: np.dtype("<f4"),
    mace_pb2.DT_UINT8: np.dtype("u1"),
    mace_pb2.DT_HALF: np.dtype("<f2"),
    mace_pb2.DT_INT32: np.dtype("<i4"),
    mace_pb2.DT_FLOAT16: np.dtype("<f2"),
    mace_pb2.DT_BFLOAT16: np.dtype("<u2"),
    mace_pb2.DT_INT16: np.dtype("<i2"),
    mace_pb2.DT_INT8: np.dtype("i1"),
}

#: MACE's DataFormat enum (mace/public/mace.h), used by the ``data_format`` and
#: ``filter_format`` args and InputOutputInfo.data_format.
DATA_FORMAT_NAMES: dict[int, str] = {
    0: "NONE", 1: "NHWC", 2: "NCHW",
    100: "HWOI", 101: "OIHW", 102: "HWIO", 103: "OHWI",
    1000: "AUTO",
}


def numpy_dtype(data_type: int) -> np.dtype:
    """The numpy dtype (as stored in .data) of a ``mace.DataType`` value."""
    try:
        return _NP_DTYPE[data_type]
    except KeyError:
        raise MaceqError(f"unsupported MACE data type {_dt_name(data_type)}") from None


def _dt_name(data_type: int) -> str:
    try:
        return mace_pb2.DataType.Name(data_type)
    except ValueError:
        return str(data_type)


# ---------------------------------------------------------------------------
# Result types


@dataclass(frozen=True)
class ModelFiles:
    """Paths of a model's files. ``ranges`` is None when there is no range file;
    ``yml`` is None only for a model read from a .pb that has no .yml beside it."""

    pb: Path
    data: Path
    yml: Path | None
    ranges: Path | None


@dataclass(frozen=True)
class LoadedModel:
    """A MACE model read by :func:`read_model`.

    ``net_def`` is the model's single NetDef (the first and only ``net_def`` of the
    MultiNetDef, or the bare NetDef of an older file). ``multi_net_def`` is the
    wrapper, or None for a bare NetDef. ``arrays`` maps each ConstTensor name to a
    numpy array of shape ``dims`` and the dtype its ``data_type`` implies (uint8,
    int32, float32, ...). ``deployment`` is the parsed .yml (None without one).
    ``checksums_verified`` is True when the .yml named these .pb/.data files and
    both sha256 checksums matched.
    """

    net_def: Any
    arrays: dict[str, np.ndarray]
    deployment: dict | None
    files: ModelFiles
    multi_net_def: Any = None
    checksums_verified: bool = False


# ---------------------------------------------------------------------------
# Arguments (small helpers for emitting and reading ops)


def add_arg(msg, name: str, value) -> Any:
    """Append ``Argument(name=name, <field>=value)`` to ``msg.arg`` and return it.

    The field follows the Python type, as MACE's converter sets them:
    bool/int -> ``i``; float -> ``f``; str/bytes -> ``s``; a sequence of ints ->
    ``ints``; a sequence containing a float -> ``floats``.
    """
    arg = msg.arg.add()
    arg.name = name
    if isinstance(value, (bool, int, np.integer)):
        arg.i = int(value)
    elif isinstance(value, (float, np.floating)):
        arg.f = float(value)
    elif isinstance(value, str):
        arg.s = value.encode("utf-8")
    elif isinstance(value, bytes):
        arg.s = value
    else:
        values = list(value)
        if all(isinstance(v, (bool, int, np.integer)) for v in values):
            arg.ints.extend(int(v) for v in values)
        else:
            arg.floats.extend(float(v) for v in values)
    return arg


_MISSING = object()


def get_arg(msg, name: str, default=_MISSING):
    """The value of the Argument called ``name`` in ``msg.arg`` (op or net).

    Returns the one field that is set: ``i`` (int), ``f`` (float), ``s`` (str),
    ``ints`` or ``floats`` (list). An arg with none set returns []. Without a
    default, a missing arg raises MaceqError naming it and the op.
    """
    for arg in msg.arg:
        if arg.name == name:
            if arg.HasField("i"):
                return int(arg.i)
            if arg.HasField("f"):
                return float(arg.f)
            if arg.HasField("s"):
                return arg.s.decode("utf-8", errors="replace")
            if len(arg.ints):
                return [int(v) for v in arg.ints]
            return [float(v) for v in arg.floats]
    if default is _MISSING:
        where = getattr(msg, "name", "") or "net"
        raise MaceqError(f"{where}: no arg {name!r}")
    return default


# ---------------------------------------------------------------------------
# .data packing


def _coerce(name: str, array, dtype: np.dtype) -> np.ndarray:
    """``array`` as ``dtype``; integer targets must hold every value exactly."""
    arr = np.asarray(array)
    if dtype.kind in "iu":
        if arr.dtype.kind not in "iub":
            if arr.dtype.kind != "f" or not np.all(np.isfinite(arr)) or not np.all(arr == np.trunc(arr)):
                raise MaceqError(f"tensor {name!r}: {arr.dtype} values are not integers "
                                 f"(its data type needs {dtype.name})")
        info = np.iinfo(dtype)
        if arr.size and (arr.min() < info.min or arr.max() > info.max):
            raise MaceqError(f"tensor {name!r}: values in [{arr.min()}, {arr.max()}] "
                             f"do not fit {dtype.name}")
    elif arr.dtype.kind not in "iubf":
        raise MaceqError(f"tensor {name!r}: cannot store a {arr.dtype} array as {dtype.name}")
    return np.ascontiguousarray(arr, dtype=dtype)


def pack_tensors(net_def, arrays: Mapping[str, np.ndarray], *, data_offset: int = 0) -> bytes:
    """Lay out ``net_def.tensors`` in one .data block, MACE's way, and return it.

    For each ConstTensor, in order, its array is taken from ``arrays[name]`` (it
    must have shape ``dims``; it is converted to the tensor's ``data_type``, integer
    types exactly or not at all) or, failing that, from the tensor's inline
    ``float_data``/``int32_data``, which is then cleared (as MACE's merge_params does).
    Padding (tools/python/utils/convert_util.py merge_params): a tensor whose
    data_type is not DT_UINT8 starts at a multiple of 4 bytes, zero bytes fill the
    gap; uint8 tensors follow at once.

    Mutates ``net_def``: sets each tensor's ``offset`` (bytes, from the block's start)
    and ``data_size`` (elements), and ``net_def.data_offset`` (= ``data_offset``, where
    the block starts in the .data file) and ``net_def.data_size`` (block length).
    """
    names = [t.name for t in net_def.tensors]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise MaceqError(f"net_def has duplicate tensor names: {sorted(dup)}")
    extra = sorted(set(arrays) - set(names))
    if extra:
        raise MaceqError(f"arrays given for tensors that are not in net_def.tensors: {extra}")
    out = bytearray()
    for tensor in net_def.tensors:
        dtype = numpy_dtype(tensor.data_type)
        dims = tuple(int(d) for d in tensor.dims)
        if tensor.name in arrays:
            arr = np.asarray(arrays[tensor.name])
            if tuple(arr.shape) != dims:
                raise MaceqError(f"tensor {tensor.name!r}: array shape {tuple(arr.shape)} "
                                 f"!= dims {list(dims)}")
        elif len(tensor.float_data) or len(tensor.int32_data):
            inline = tensor.float_data if len(tensor.float_data) else tensor.int32_data
            arr = np.array(list(inline))
            if arr.size != math.prod(dims):
                raise MaceqError(f"tensor {tensor.name!r}: {arr.size} inline values "
                                 f"!= {math.prod(dims)} elements of dims {list(dims)}")
            arr = arr.reshape(dims)
        else:
            raise MaceqError(f"tensor {tensor.name!r}: no array given and no inline data")
        raw = _coerce(tensor.name, arr, dtype).tobytes()
        if tensor.data_type != mace_pb2.DT_UINT8 and len(out) % 4:
            out.extend(b"\0" * (4 - len(out) % 4))
        tensor.offset = len(out)
        tensor.data_size = int(arr.size)
        tensor.ClearField("float_data")
        tensor.ClearField("int32_data")
        out.extend(raw)
    net_def.data_offset = int(data_offset)
    net_def.data_size = len(out)
    return bytes(out)


def unpack_tensors(net_def, data: bytes, *, source: str = ".data") -> dict[str, np.ndarray]:
    """The arrays of ``net_def.tensors`` read from the whole .data file ``data``.

    Tensor ``t`` occupies bytes ``net_def.data_offset + t.offset`` onward,
    ``t.data_size`` elements of its data type. A tensor with inline
    ``float_data``/``int32_data`` takes its values from there instead. Each array
    is a fresh copy of shape ``dims``. ``source`` names the file in errors.
    """
    arrays: dict[str, np.ndarray] = {}
    base = int(net_def.data_offset)
    if base < 0:
        raise MaceqError(f"{source}: negative data_offset {base}")
    if net_def.HasField("data_size") and base + net_def.data_size > len(data):
        raise MaceqError(f"{source}: truncated: the net's weights need bytes "
                         f"{base}..{base + net_def.data_size} but the file has {len(data)}")
    for tensor in net_def.tensors:
        if tensor.data_type not in _NP_DTYPE:
            raise MaceqError(f"{source}: tensor {tensor.name!r} has unsupported data type "
                             f"{_dt_name(tensor.data_type)}")
        dtype = _NP_DTYPE[tensor.data_type]
        dims = tuple(int(d) for d in tensor.dims)
        if any(d < 0 for d in dims):
            raise MaceqError(f"{source}: tensor {tensor.name!r} has negative dims {list(dims)}")
        count = math.prod(dims)
        if len(tensor.float_data) or len(tensor.int32_data):
            inline = tensor.float_data if len(tensor.float_data) else tensor.int32_data
            if len(inline) != count:
                raise MaceqError(f"{source}: tensor {tensor.name!r} has {len(inline)} inline "
                                 f"values for dims {list(dims)}")
            arrays[tensor.name] = np.array(list(inline)).astype(dtype).reshape(dims)
            continue
        if tensor.data_size != count:
            raise MaceqError(f"{source}: tensor {tensor.name!r} has data_size "
                             f"{tensor.data_size} but dims {list(dims)} hold {count}")
        start = base + int(tensor.offset)
        end = start + count * dtype.itemsize
        if tensor.offset < 0 or end > len(data):
            raise MaceqError(f"{source}: truncated: tensor {tensor.name!r} needs bytes "
                             f"{start}..{end} but the file has {len(data)}")
        arrays[tensor.name] = np.frombuffer(data, dtype=dtype, count=count,
                                            offset=start).reshape(dims).copy()
    return arrays


# ---------------------------------------------------------------------------
# Range file


def format_ranges(ranges: Mapping[str, tuple[float, float]]) -> str:
    """MACE's range-file text: ``name@@min,max`` per line, floats in repr form."""
    lines = []
    for name, pair in ranges.items():
        if not isinstance(name, str) or not name or "@@" in name or "\n" in name or "\r" in name:
            raise MaceqError(f"range file: tensor name {name!r} cannot be written "
                             f"(empty, or holds '@@' or a line break)")
        try:
            lo, hi = (float(v) for v in pair)
        except (TypeError, ValueError):
            raise MaceqError(f"range file: tensor {name!r}: range {pair!r} is not two numbers") from None
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise MaceqError(f"range file: tensor {name!r}: bad range [{lo!r}, {hi!r}]")
        lines.append(f"{name}@@{lo!r},{hi!r}\n")
    return "".join(lines)


def parse_ranges(text: str, *, source: str = "range file") -> dict[str, tuple[float, float]]:
    """Parse MACE's range-file text (``name@@min,max`` per line; blank lines skipped).

    MACE reads it with ``name, minmax = line.split('@@')`` and
    ``[float(i) for i in minmax.strip().split(',')]``
    (tools/python/transform/transformer.py add_quantize_tensor_range).
    """
    out: dict[str, tuple[float, float]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("@@")
        if len(parts) != 2 or not parts[0]:
            raise MaceqError(f"{source}:{lineno}: expected 'tensor@@min,max', got {line!r}")
        name, minmax = parts
        try:
            lo, hi = (float(v) for v in minmax.strip().split(","))
        except ValueError:
            raise MaceqError(f"{source}:{lineno}: expected 'tensor@@min,max', got {line!r}") from None
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo > hi:
            raise MaceqError(f"{source}:{lineno}: tensor {name!r}: bad range [{lo!r}, {hi!r}]")
        if name in out:
            raise MaceqError(f"{source}:{lineno}: tensor {name!r} appears twice")
        out[name] = (lo, hi)
    return out


def read_ranges(path) -> dict[str, tuple[float, float]]:
    """Read a MACE range file into {tensor: (min, max)}, in file order."""
    path = Path(path)
    try:
        return parse_ranges(_read_text(path), source=str(path))
    except MaceqError as e:
        raise MaceqError(one_line(str(e))) from None


def write_ranges(path, ranges: Mapping[str, tuple[float, float]]) -> Path:
    """Write a MACE range file atomically (temp file + os.replace); return its path."""
    path = Path(path)
    atomic_write(path, format_ranges(ranges).encode("utf-8"))
    return path


# ---------------------------------------------------------------------------
# Files



def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise MaceqError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise MaceqError(f"{path}: is a folder, not a file") from None
    except OSError as e:
        raise MaceqError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError:  # a path with a NUL byte (from a yml key)
        raise MaceqError(f"{path!r}: not a usable file name") from None


def _read_text(path: Path) -> str:
    try:
        return _read_bytes(path).decode("utf-8")
    except UnicodeDecodeError:
        raise MaceqError(f"{path}: not UTF-8 text") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def sha256_hex(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


# ---------------------------------------------------------------------------
# .pb parsing


def _top_level_fields(buf: bytes) -> list[int] | None:
    """Field numbers of the top-level records of a protobuf message, or None if
    ``buf`` is not well-formed protobuf wire format at the top level."""
    out = []
    i, n = 0, len(buf)

    def varint(i):
        shift = result = 0
        while True:
            if i >= n or shift > 63:
                return None, i
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return result, i

    while i < n:
        key, i = varint(i)
        if key is None:
            return None
        field, wire = key >> 3, key & 7
        if field == 0:
            return None
        if wire == 0:
            v, i = varint(i)
            if v is None:
                return None
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            length, i = varint(i)
            if length is None:
                return None
            i += length
        else:
            return None
        if i > n:
            return None
        out.append(field)
    return out


_MULTI_FIELDS = {3, 100, 101}


def parse_model_proto(payload: bytes, *, source: str = ".pb"):
    """Parse a .pb payload: returns ``(multi_net_def_or_None, net_def)``.

    A MultiNetDef has only fields 3 (net_def), 100 and 101 at the top level; any
    other top-level field (op = 1, arg = 2, data_type = 4, ...) marks a bare
    NetDef as older MACE versions wrote it. Exactly one net_def is supported.
    """
    fields = _top_level_fields(payload)
    if fields is None:
        raise MaceqError(f"{source}: not a MACE model (not protobuf data)")
    is_multi = bool(fields) and set(fields) <= _MULTI_FIELDS
    cls = mace_pb2.MultiNetDef if is_multi else mace_pb2.NetDef
    msg = cls()
    try:
        msg.ParseFromString(payload)
    except Exception as e:  # DecodeError, or whatever a backend raises on hostile bytes
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MaceqError(f"{source}: not a MACE model ({cls.__name__} does not parse: {reason})") from None
    if is_multi:
        if len(msg.net_def) != 1:
            raise MaceqError(f"{source}: has {len(msg.net_def)} subgraphs; maceq reads models "
                             f"with exactly one net_def")
        multi, net = msg, msg.net_def[0]
    else:
        multi, net = None, msg
    if len(net.op) == 0:
        raise MaceqError(f"{source}: not a MACE model (the net has no ops)")
    return multi, net


def dump_text(msg) -> str:
    """Protobuf text form of a MACE message (what MACE's converter writes to .pb_txt).

    This is ``str(msg)``: with the upb/cpp protobuf backends (the default) it prints
    floats like C++ (``0.0111092599``, ``6``), and the dump of a MultiNetDef is
    byte-identical to MACE's ``<name>.pb_txt``. (``text_format.MessageToString`` and
    the pure-python backend print the shortest repr instead: ``0.01110926``, ``6.0``.)
    """
    return str(msg)


# ---------------------------------------------------------------------------
# Deployment yml

_FORMAT_NAMES_FOR_YML = {0: "NONE", 1: "NHWC", 2: "NCHW"}


def _fmt_shape(dims) -> str:
    return ",".join(str(int(d)) for d in dims)


def _fmt_range(pair) -> str:
    return f"{float(pair[0])!r},{float(pair[1])!r}"


def _default_subgraph(multi, net, ranges) -> dict:
    inputs = list(multi.input_tensor) or [i.name for i in net.input_info]
    outputs = list(multi.output_tensor) or [o.name for o in net.output_info]
    in_info = {i.name: i for i in net.input_info}
    out_info = {o.name: o for o in net.output_info}
    sub: dict[str, Any] = {"input_tensors": inputs}
    sub["input_shapes"] = [_fmt_shape(in_info[n].dims) if n in in_info else "" for n in inputs]
    sub["input_data_formats"] = [
        _FORMAT_NAMES_FOR_YML.get(in_info[n].data_format, "NHWC") if n in in_info else "NHWC"
        for n in inputs]
    if ranges is not None and all(n in ranges for n in inputs):
        sub["input_ranges"] = [_fmt_range(ranges[n]) for n in inputs]
    sub["output_tensors"] = outputs
    sub["output_shapes"] = [_fmt_shape(out_info[n].dims) if n in out_info else "" for n in outputs]
    sub["output_data_formats"] = [
        _FORMAT_NAMES_FOR_YML.get(out_info[n].data_format, "NHWC") if n in out_info else "NHWC"
        for n in outputs]
    return sub


def _plain(value, key: str):
    """``value`` with numpy scalars/arrays turned into YAML-safe Python values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), key)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise MaceqError(f"deployment key {key!r}: cannot write a {type(value).__name__} to YAML")


_TOP_KEYS = ("library_name", "target_abis", "model_graph_format", "model_data_format")
_WRITER_MODEL_KEYS = ("model_file_path", "model_sha256_checksum",
                      "weight_file_path", "weight_sha256_checksum", "quantize_range_file")


def _net_is_quantized(net) -> bool:
    return get_arg(net, "quantize_flag", 0) == 1 or any(
        t.data_type == mace_pb2.DT_UINT8 for t in net.tensors)


def write_model(out_dir, name: str, model, arrays: Mapping[str, np.ndarray], *,
                deployment: Mapping[str, Any] | None = None,
                ranges: Mapping[str, tuple[float, float]] | None = None,
                maceq: Mapping[str, Any] | None = None) -> ModelFiles:
    """Write ``<name>.pb``, ``<name>.data``, ``<name>_ranges.txt`` and ``<name>.yml``.

    ``model`` is a MultiNetDef (exactly one net_def) or a NetDef, which is wrapped
    in a MultiNetDef whose input_tensor/output_tensor are the names of its
    input_info/output_info. The caller's message is not modified: a copy gets the
    offsets of :func:`pack_tensors` (``arrays`` supplies the weights).

    ``deployment`` supplies the yml: the top-level keys ``library_name`` (default
    ``name``) and ``target_abis`` (default ``[arm64-v8a]``) and every model-level
    key (``platform``, ``subgraphs``, ``runtime``, ``quantize``, ...), which are
    written under ``models: {name: ...}``. The writer always sets
    ``model_graph_format: file``, ``model_data_format: file``, ``model_file_path``
    and ``weight_file_path`` (``./<name>.pb``/``./<name>.data``, relative to the
    yml) with their sha256 checksums, and ``quantize_range_file`` when ``ranges``
    is given. Defaults: ``runtime: cpu``; ``quantize``: 1 for a quantized net, else
    0; ``subgraphs``: one, built from the net's input_info/output_info (NHWC shapes)
    and the input ranges. ``maceq`` goes under a top-level ``maceq:`` key.

    Deterministic: the same arguments give the same bytes.
    """
    out_dir = Path(out_dir)
    check_model_name(name)
    if not out_dir.is_dir():
        raise MaceqError(f"{out_dir}: no such folder")
    deployment = dict(deployment or {})
    multi = _as_multi_net(model, name)
    net = multi.net_def[0]
    data = pack_tensors(net, arrays, data_offset=0)
    pb = multi.SerializeToString(deterministic=True)

    files = ModelFiles(pb=out_dir / f"{name}.pb", data=out_dir / f"{name}.data",
                       yml=out_dir / f"{name}.yml",
                       ranges=(out_dir / f"{name}_ranges.txt") if ranges is not None else None)
    ranges_text = format_ranges(ranges) if ranges is not None else None
    # Build the yml before touching the disk, so that bad keys fail early.
    yml_text = _deployment_yml(name, multi, files, pb, data, ranges, deployment, maceq)
    _write_model_files(out_dir, name, files, pb, data, ranges_text, yml_text)
    return files


def _as_multi_net(model, name: str):
    """A copy of ``model`` as a MultiNetDef of exactly one net_def (a NetDef is wrapped); MaceqError otherwise."""
    if isinstance(model, mace_pb2.MultiNetDef):
        multi = mace_pb2.MultiNetDef()
        multi.CopyFrom(model)
        if len(multi.net_def) != 1:
            raise MaceqError(f"model {name!r}: has {len(multi.net_def)} net_defs; "
                             f"maceq writes exactly one")
        return multi
    if isinstance(model, mace_pb2.NetDef):
        multi = mace_pb2.MultiNetDef()
        multi.net_def.add().CopyFrom(model)
        multi.input_tensor.extend(i.name for i in model.input_info)
        multi.output_tensor.extend(o.name for o in model.output_info)
        return multi
    raise MaceqError(f"model {name!r}: expected a mace MultiNetDef or NetDef, "
                     f"got {type(model).__name__}")


def _deployment_yml(name: str, multi, files: ModelFiles, pb: bytes, data: bytes,
                    ranges: Mapping[str, tuple[float, float]] | None, deployment: dict[str, Any],
                    maceq: Mapping[str, Any] | None) -> str:
    """The text of ``<name>.yml`` as :func:`write_model` describes it; ``deployment`` is consumed."""
    net = multi.net_def[0]
    top = {
        "library_name": deployment.pop("library_name", name),
        "target_abis": deployment.pop("target_abis", ["arm64-v8a"]),
        "model_graph_format": "file",
        "model_data_format": "file",
    }
    for key in _TOP_KEYS[2:]:
        deployment.pop(key, None)
    entry: dict[str, Any] = {"platform": deployment.pop("platform", "onnx")}
    entry["model_file_path"] = f"./{files.pb.name}"
    entry["model_sha256_checksum"] = sha256_hex(pb)
    entry["weight_file_path"] = f"./{files.data.name}"
    entry["weight_sha256_checksum"] = sha256_hex(data)
    entry["subgraphs"] = deployment.pop("subgraphs", None) or [
        _default_subgraph(multi, net, ranges)]
    entry["runtime"] = deployment.pop("runtime", "cpu")
    entry["quantize"] = deployment.pop("quantize", 1 if _net_is_quantized(net) else 0)
    if files.ranges is not None:
        entry["quantize_range_file"] = f"./{files.ranges.name}"
    for key in _WRITER_MODEL_KEYS:
        deployment.pop(key, None)
    entry.update(deployment)
    doc: dict[str, Any] = dict(top)
    doc["models"] = {name: entry}
    if maceq is not None:
        doc["maceq"] = dict(maceq)
    doc = _plain(doc, "yml")
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=False,
                          allow_unicode=True, width=1000)


def _write_model_files(out_dir: Path, name: str, files: ModelFiles, pb: bytes, data: bytes,
                       ranges_text: str | None, yml_text: str) -> None:
    """Write the model's files as one set into ``out_dir``, the yml last; MaceqError for a path outside it."""
    for p in (files.pb, files.data, files.yml, files.ranges):
        if p is not None and p.parent.resolve() != out_dir.resolve():  # defence in depth; the name is checked
            raise MaceqError(f"model name {name!r}: {p.name} would be written outside {out_dir}")
    payloads = [(files.data, data), (files.pb, pb)]
    if files.ranges is not None:
        payloads.append((files.ranges, ranges_text.encode("utf-8")))
    payloads.append((files.yml, yml_text.encode("utf-8")))
    _commit_set(out_dir, name, payloads)


#: The most bytes (UTF-8) of a model name: the longest file made from it, the staging folder
#: ``.<name>.staging-<pid>-<random>``, stays within the usual NAME_MAX of 255.
MAX_NAME_BYTES = 200


def check_model_name(name) -> str:
    """``name`` if it is usable as the stem of the model's files, else MaceqError.

    A plain file stem: a non-empty str of at most :data:`MAX_NAME_BYTES` UTF-8 bytes, with no
    path separator (``/``, ``\\``, ``os.sep``, ``os.altsep``), no NUL or other control character
    (line breaks included), not ``.`` or ``..`` and not starting with ``.`` (hidden files, and
    the writer's own staging folders, start with one). So ``<out_dir>/<name>.pb`` is always a file
    directly inside ``out_dir``.
    """
    ok = isinstance(name, str) and bool(name) and not name.startswith(".")
    if ok:
        seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
        ok = (not any(c in seps for c in name)
              and not any(ord(c) < 32 or ord(c) == 127 or c in "\x85\u2028\u2029" for c in name))
    if ok:
        try:
            ok = len(name.encode("utf-8")) <= MAX_NAME_BYTES
        except UnicodeEncodeError:  # a lone surrogate
            ok = False
    if not ok:
        raise MaceqError(f"model name {one_line(repr(name))}: must be a plain file stem (no path separator, "
                         f"control character or leading '.', at most {MAX_NAME_BYTES} bytes)")
    return name


_STAGING = ".staging-"


def _remove_dead_staging(out_dir: Path, name: str) -> None:
    """Remove the staging folders of ``name`` left by writers that no longer run (killed ones)."""
    prefix = f".{name}{_STAGING}"
    try:
        entries = list(os.scandir(out_dir))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        pid_text = entry.name[len(prefix):].split("-", 1)[0]
        if pid_text.isdigit() and int(pid_text) != os.getpid() and _pid_alive(int(pid_text)):
            continue  # another live writer's
        _rmtree_quiet(Path(entry.path))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's), or cannot tell: keep its folder
    return True


def _rmtree_quiet(folder: Path) -> None:
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. a platform that cannot open folders
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit_set(out_dir: Path, name: str, payloads: list[tuple[Path, bytes]]) -> None:
    """Write ``payloads`` (final path, bytes) as one set; the last one is the commit record (.yml).

    1. every file is written and fsynced in a fresh staging folder inside ``out_dir``;
    2. the old commit record is removed, then the old ``.pb`` (so that a new ``.data`` never
       sits next to an old ``.pb``; payloads[1] is the .pb, payloads[0] the .data);
    3. the staged files are renamed into place in ``payloads`` order, the record last;
    4. the folder is fsynced and the staging folder removed.
    A kill during 1 leaves the previous set untouched; during 2-3, no record (no model) and
    never a mismatched .pb/.data pair. OSError becomes MaceqError naming the file.
    """
    _remove_dead_staging(out_dir, name)
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{name}{_STAGING}{os.getpid()}-", dir=out_dir))
    except OSError as e:
        raise MaceqError(f"{out_dir}: cannot write: {e.strerror or e}") from None
    try:
        mode = 0o666 & ~_umask()
        staged = []
        for final, payload in payloads:
            tmp = staging / final.name
            try:
                with open(tmp, "wb") as f:
                    f.write(payload)
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, mode)
            except OSError as e:
                raise MaceqError(f"{final}: cannot write: {e.strerror or e}") from None
            staged.append((tmp, final))
        _fsync_dir(staging)
        record, pb = payloads[-1][0], payloads[1][0]
        for old in (record, pb):
            try:
                old.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise MaceqError(f"{old}: cannot remove the old file: {e.strerror or e}") from None
        for tmp, final in staged:
            try:
                os.replace(tmp, final)
            except OSError as e:
                raise MaceqError(f"{final}: cannot write: {e.strerror or e}") from None
        _fsync_dir(out_dir)
    finally:
        _rmtree_quiet(staging)


# ---------------------------------------------------------------------------
# Reading


def _load_yml(path: Path) -> dict:
    try:
        doc = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise MaceqError(f"{path}: not valid YAML{where}") from None
    except RecursionError:  # PyYAML's composer recurses once per nesting level
        raise MaceqError(f"{path}: YAML nested too deeply") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict) or not doc["models"]:
        raise MaceqError(f"{path}: not a MACE deployment file (no 'models' mapping)")
    return doc


def _model_entry(doc: dict, yml: Path, stem: str | None) -> tuple[str, dict]:
    models = doc["models"]
    if stem is not None and stem in models:
        name = stem
    elif len(models) == 1:
        name = next(iter(models))
    else:
        raise MaceqError(f"{yml}: holds {len(models)} models {sorted(map(str, models))}; "
                         f"none is called {stem!r}")
    entry = models[name]
    if not isinstance(entry, dict):
        raise MaceqError(f"{yml}: models.{name} is not a mapping")
    return str(name), entry


def _entry_path(yml: Path, entry: dict, key: str, suffix: str) -> Path | None:
    """The file that ``entry[key]`` names, when it names a ``suffix`` file."""
    value = entry.get(key)
    if isinstance(value, str) and value.endswith(suffix) and "://" not in value:
        p = Path(value)
        return p if p.is_absolute() else yml.parent / p
    return None


def read_model(path) -> LoadedModel:
    """Read a MACE model from its ``.yml``, or from its ``.pb``.

    * ``.yml``/``.yaml``: the model entry is ``models[<yml stem>]`` or the only one.
      The .pb/.data are the files that ``model_file_path``/``weight_file_path`` name
      when those end in ``.pb``/``.data`` (relative to the yml); otherwise (MACE's own
      yml names the source model there) ``<model name>.pb``/``.data`` next to the yml.
    * ``.pb`` (any other name): ``<stem>.data`` next to it; ``<stem>.yml`` is read
      too when present.

    When the yml's path keys name the .pb/.data that were read, their
    ``model_sha256_checksum``/``weight_sha256_checksum`` must match
    (``checksums_verified`` tells whether they were checked). A missing file, a
    garbage .pb, a checksum mismatch or a truncated .data raises MaceqError (one line: line breaks
    in names taken from the files are escaped).
    """
    try:
        return _read_model(Path(path))
    except MaceqError as e:
        raise MaceqError(one_line(str(e))) from None


def _read_model(path: Path) -> LoadedModel:
    if path.suffix.lower() == ".onnx":
        raise MaceqError(f"{path}: an ONNX model; give the quantized model's .yml (`quantize` writes it)")
    if path.is_dir():
        raise MaceqError(f"{path}: a folder; give the quantized model's .yml")
    deployment = None
    pb_from_yml = data_from_yml = False
    entry: dict = {}
    if path.suffix in (".yml", ".yaml"):
        yml = path
        deployment = _load_yml(yml)
        model_name, entry = _model_entry(deployment, yml, yml.stem)
        pb_path = _entry_path(yml, entry, "model_file_path", ".pb")
        data_path = _entry_path(yml, entry, "weight_file_path", ".data")
        pb_from_yml, data_from_yml = pb_path is not None, data_path is not None
        pb_path = pb_path or yml.parent / f"{model_name}.pb"
        data_path = data_path or yml.parent / f"{model_name}.data"
    else:
        pb_path = path
        data_path = path.with_suffix(".data")
        yml = path.with_suffix(".yml")
        if yml.is_file():
            deployment = _load_yml(yml)
            _, entry = _model_entry(deployment, yml, path.stem)
            named_pb = _entry_path(yml, entry, "model_file_path", ".pb")
            named_data = _entry_path(yml, entry, "weight_file_path", ".data")
            pb_from_yml = named_pb is not None and _same_file(named_pb, pb_path)
            data_from_yml = named_data is not None and _same_file(named_data, data_path)
        else:
            yml = None

    pb = _read_bytes(pb_path)
    data = _read_bytes(data_path)
    verified = False
    if deployment is not None:
        checks = []
        if pb_from_yml:
            checks.append((pb_path, pb, "model_sha256_checksum"))
        if data_from_yml:
            checks.append((data_path, data, "weight_sha256_checksum"))
        for fpath, payload, key in checks:
            want = entry.get(key)
            if not isinstance(want, str) or not want:
                raise MaceqError(f"{yml}: no {key} for {fpath.name}")
            got = sha256_hex(payload)
            if got != want.strip().lower():
                raise MaceqError(f"{fpath}: sha256 {got} does not match {key} in {yml.name}")
        verified = pb_from_yml and data_from_yml

    multi, net = parse_model_proto(pb, source=str(pb_path))
    arrays = unpack_tensors(net, data, source=str(data_path))
    ranges_path = None
    rf = entry.get("quantize_range_file") if entry else None
    if isinstance(rf, str) and yml is not None:
        p = Path(rf)
        ranges_path = p if p.is_absolute() else yml.parent / p
    files = ModelFiles(pb=pb_path, data=data_path, yml=yml, ranges=ranges_path)
    return LoadedModel(net_def=net, arrays=arrays, deployment=deployment, files=files,
                       multi_net_def=multi, checksums_verified=verified)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


__all__ = [
    "ModelFiles", "LoadedModel", "DATA_FORMAT_NAMES", "numpy_dtype", "add_arg", "get_arg",
    "pack_tensors", "unpack_tensors", "format_ranges", "parse_ranges", "read_ranges",
    "write_ranges", "parse_model_proto", "dump_text", "write_model", "read_model", "sha256_hex",
    "check_model_name", "MAX_NAME_BYTES",
]
