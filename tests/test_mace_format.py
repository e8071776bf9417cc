"""The MACE model format: schema, reader and writer, against MACE's own files.

Oracles: the files that MACE's converter wrote (../shared/data/mace_reference:
fmnist_q8.pb/.data/.pb_txt, fmnist_fp32.pb/.data, fmnist_ranges.txt), the source
ONNX model's weights, raw byte slices of .data read with ``struct``, and
mace.proto parsed by a tiny parser written here.
"""
from __future__ import annotations

import hashlib
import math
import os
import re
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from google.protobuf import descriptor_pb2, text_format
from google.protobuf.internal import api_implementation

from maceq.errors import MaceqError
from maceq.mace import (
    add_arg,
    dump_text,
    get_arg,
    mace_pb2,
    pack_tensors,
    parse_ranges,
    read_model,
    read_ranges,
    write_model,
    write_ranges,
)
from maceq.mace import format as mace_format

REF = Path(__file__).resolve().parents[2] / "shared" / "data" / "mace_reference"
if not REF.is_dir():  # the repo may live elsewhere; the data is always here
    REF = Path("/work/shared/data/mace_reference")
ONNX_MODEL = REF.parent / "models" / "fmnist_mobilenet.onnx"
PROTO = Path(mace_pb2.__file__).with_name("mace.proto")


def _f32(x: float) -> float:
    return float(np.float32(x))


@pytest.fixture(scope="module")
def ref():
    return read_model(REF / "fmnist_q8.yml")


# ---------------------------------------------------------------------------
# Schema: mace.proto == the Python descriptor == the reference files

_SCALARS = {
    "double": 1, "float": 2, "int64": 3, "uint64": 4, "int32": 5, "fixed64": 6,
    "fixed32": 7, "bool": 8, "string": 9, "bytes": 12, "uint32": 13, "sint32": 17,
    "sint64": 18,
}


def _parse_proto(text: str) -> descriptor_pb2.FileDescriptorProto:
    """A tiny proto2 parser (flat enums and messages) -> FileDescriptorProto."""
    text = re.sub(r"//[^\n]*", "", text)
    fdp = descriptor_pb2.FileDescriptorProto()
    fdp.syntax = re.search(r'syntax\s*=\s*"(\w+)"\s*;', text).group(1)
    fdp.package = re.search(r"package\s+([\w.]+)\s*;", text).group(1)
    if re.search(r"option\s+optimize_for\s*=\s*LITE_RUNTIME\s*;", text):
        fdp.options.optimize_for = descriptor_pb2.FileOptions.LITE_RUNTIME
    blocks = re.findall(r"\b(enum|message)\s+(\w+)\s*\{([^{}]*)\}", text)
    enums = {name for kind, name, _ in blocks if kind == "enum"}
    for kind, name, body in blocks:
        if kind == "enum":
            e = fdp.enum_type.add(name=name)
            for vname, num in re.findall(r"(\w+)\s*=\s*(-?\d+)\s*;", body):
                e.value.add(name=vname, number=int(num))
            continue
        m = fdp.message_type.add(name=name)
        for stmt in filter(None, (s.strip() for s in body.split(";"))):
            g = re.fullmatch(r"(optional|repeated|required)\s+([\w.]+)\s+(\w+)\s*=\s*(\d+)"
                             r"\s*(?:\[(.*)\])?", stmt, re.S)
            assert g, f"cannot parse field {stmt!r}"
            label, ftype, fname, num, opts = g.groups()
            f = m.field.add(name=fname, number=int(num))
            f.label = {"optional": 1, "required": 2, "repeated": 3}[label]
            if ftype in _SCALARS:
                f.type = _SCALARS[ftype]
            else:
                f.type = 14 if ftype in enums else 11
                f.type_name = f".{fdp.package}.{ftype}"
            for key, value in re.findall(r"(\w+)\s*=\s*([\w.\-]+)", opts or ""):
                if key == "default":
                    f.default_value = value
                elif key == "packed":
                    f.options.packed = value == "true"
                else:
                    raise AssertionError(f"unknown option {key}")
    return fdp


def test_proto_file_and_python_descriptor_agree():
    parsed = _parse_proto(PROTO.read_text())
    built = descriptor_pb2.FileDescriptorProto()
    mace_pb2.DESCRIPTOR.CopyToProto(built)
    built.ClearField("name")
    assert built.package == "mace"
    assert parsed.syntax == "proto2" and built.syntax in ("", "proto2")  # "" means proto2
    parsed.ClearField("syntax")
    built.ClearField("syntax")
    # Compare message by message, so that a failure names the odd one out.
    assert [e.name for e in built.enum_type] == [e.name for e in parsed.enum_type]
    for a, b in zip(built.enum_type, parsed.enum_type):
        assert a == b, a.name
    assert [m.name for m in built.message_type] == [m.name for m in parsed.message_type]
    for a, b in zip(built.message_type, parsed.message_type):
        assert a == b, a.name
    assert built == parsed
    assert mace_pb2.build_file_descriptor_proto().package == "mace"


def _wire_fields(buf: bytes) -> list[tuple[int, int]]:
    """(field number, wire type) of each top-level record, decoded by hand."""
    out, i = [], 0

    def varint(i):
        r = s = 0
        while True:
            b = buf[i]
            i += 1
            r |= (b & 0x7F) << s
            s += 7
            if b < 0x80:
                return r, i

    while i < len(buf):
        key, i = varint(i)
        f, w = key >> 3, key & 7
        if w == 0:
            _, i = varint(i)
        elif w == 2:
            n, i = varint(i)
            i += n
        elif w == 5:
            i += 4
        elif w == 1:
            i += 8
        out.append((f, w))
    return out


def test_reference_pb_parses_to_the_reference_text_and_reserializes_identically():
    payload = (REF / "fmnist_q8.pb").read_bytes()
    ref_txt = (REF / "fmnist_q8.pb_txt").read_text()
    multi = mace_pb2.MultiNetDef()
    multi.ParseFromString(payload)
    # The text parser of the same schema reads MACE's dump back to the same message.
    assert text_format.Parse(ref_txt, mace_pb2.MultiNetDef()) == multi
    if api_implementation.Type() != "python":
        # upb/cpp print floats like MACE's converter did (C++ SimpleFtoa).
        assert str(multi) == ref_txt
        assert dump_text(multi) == ref_txt
    assert multi.SerializeToString() == payload
    # No field of the file is unknown to the schema, at any depth.
    assert multi.SerializeToString() == multi.SerializeToString(deterministic=True)
    top = Counter(_wire_fields(payload))
    assert top == {(3, 2): 1, (100, 2): 1, (101, 2): 1}
    net_fields = Counter(_wire_fields(multi.net_def[0].SerializeToString()))
    assert {f for f, _ in net_fields} == {1, 2, 3, 4, 5, 6, 7, 8, 100, 101}
    for f in (4, 6, 7, 8):
        assert net_fields[(f, 0)] == 1
    # MultiNetDef field numbers from the raw bytes: 3 = net_def, 100/101 = names.
    assert multi.input_tensor == ["input"] and multi.output_tensor == ["logits"]


def test_fp32_reference_reserializes_identically():
    payload = (REF / "fmnist_fp32.pb").read_bytes()
    multi = mace_pb2.MultiNetDef()
    multi.ParseFromString(payload)
    assert multi.SerializeToString() == payload
    assert len(multi.net_def) == 1 and multi.net_def[0].data_size == 289712


# ---------------------------------------------------------------------------
# Reader on the reference model


def test_reference_values(ref):
    net = ref.net_def
    data = (REF / "fmnist_q8.data").read_bytes()
    tensors = {t.name: t for t in net.tensors}
    t = tensors["onnx::Conv_212"]
    assert list(t.dims) == [16, 3, 3, 1]
    assert t.data_type == mace_pb2.DT_UINT8
    assert t.offset == 1320 and t.data_size == 144
    assert t.scale == _f32(0.00885939691) and t.zero_point == 141
    assert t.minval == _f32(-1.24917495) and t.maxval == _f32(1.00997126)
    a = ref.arrays["onnx::Conv_212"]
    assert a.dtype == np.uint8 and a.shape == (16, 3, 3, 1)
    assert a.tobytes() == data[1320:1320 + 144]
    assert a.ravel()[:4].tolist() == list(data[1320:1324])

    bias = ref.arrays["10.bias"]
    assert bias.dtype == np.int32 and bias.shape == (10,)
    assert bias.tolist() == list(struct.unpack("<10i", data[1280:1320]))
    assert tensors["10.bias"].scale == _f32(5.5177803e-05)
    assert tensors["10.weight"].offset == 0 and tensors["10.weight"].zero_point == 117
    assert list(tensors["onnx::Conv_213"].dims) == [16] and tensors["onnx::Conv_213"].offset == 1464

    types = Counter(op.type for op in net.op)
    assert types == {"Conv2D": 14, "DepthwiseConv2d": 6, "Eltwise": 3, "Quantize": 1,
                     "Reduce": 1, "FullyConnected": 1, "Dequantize": 1}
    (inp,) = net.input_info
    assert inp.name == "input" and inp.alias == "input" and list(inp.dims) == [1, 28, 28, 1]
    assert inp.scale == _f32(0.0111092599) and inp.zero_point == 73 and inp.data_format == 1
    (out,) = net.output_info
    assert out.scale == _f32(0.0833763704) and out.zero_point == 109 and out.data_format == 0
    q = net.op[0]
    assert q.type == "Quantize" and q.quantize_info[0].zero_point == 73
    assert get_arg(q, "find_range_every_time") == 1
    assert get_arg(net.op[1], "padding_values") == [2, 2]
    assert get_arg(net.op[1], "activation") == "RELUX" and get_arg(net.op[1], "max_limit") == 6.0
    assert get_arg(net, "filter_format") == 103 and get_arg(net, "quantize_flag") == 1
    assert net.op[-1].output_type == [mace_pb2.DT_FLOAT]
    assert ref.deployment["models"]["fmnist_q8"]["quantize"] == 1
    assert ref.files.ranges == REF / "fmnist_ranges.txt"
    # MACE's own yml names the source ONNX model: the checksums are not ours to check.
    assert ref.checksums_verified is False


def test_reference_weights_match_the_source_onnx_model(ref):
    """The layouts (Conv2D OHWI, DepthwiseConv2d [KH,KW,C,M], FC [O,1,1,I]) against
    the ONNX weights: dequantized values lie within one step of the float weight."""
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    weights = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(ONNX_MODEL)).graph.initializer}
    tensors = {t.name: t for t in ref.net_def.tensors}
    filters = {op.input[1]: op.type for op in ref.net_def.op if len(op.input) == 3}
    assert len(filters) == 21
    for name, op_type in filters.items():
        w = weights[name]
        if op_type == "Conv2D":           # ONNX OIHW -> OHWI
            w = w.transpose(0, 2, 3, 1)
        elif op_type == "DepthwiseConv2d":  # ONNX [C*M,1,KH,KW] -> [KH,KW,C,M]
            w = w.transpose(2, 3, 0, 1)
        else:                              # Gemm [O,I] -> [O,1,1,I]
            w = w.reshape(w.shape[0], 1, 1, w.shape[1])
        t = tensors[name]
        deq = (ref.arrays[name].astype(np.float64) - t.zero_point) * np.float64(np.float32(t.scale))
        assert deq.shape == w.shape
        assert np.abs(deq - w).max() <= np.float32(t.scale), name
        bias = tensors[_bias_of(ref.net_def, name)]
        b = ref.arrays[bias.name] * np.float64(np.float32(bias.scale))
        assert np.abs(b - weights[bias.name]).max() <= np.float32(bias.scale), bias.name


def _bias_of(net, filter_name):
    for op in net.op:
        if len(op.input) == 3 and op.input[1] == filter_name:
            return op.input[2]
    return None


def test_read_from_pb_finds_data_and_yml(ref):
    m = read_model(REF / "fmnist_q8.pb")
    assert m.files.data == REF / "fmnist_q8.data" and m.files.yml == REF / "fmnist_q8.yml"
    assert m.deployment == ref.deployment
    assert m.net_def == ref.net_def
    assert m.arrays.keys() == ref.arrays.keys()
    fp = read_model(REF / "fmnist_fp32.pb")
    assert fp.deployment is None and fp.files.yml is None
    w = fp.arrays["onnx::Conv_212"]
    assert w.dtype == np.float32 and w.shape == (16, 1, 3, 3)
    raw = (REF / "fmnist_fp32.data").read_bytes()
    off = next(t.offset for t in fp.net_def.tensors if t.name == "onnx::Conv_212")
    assert w.ravel()[:3].tolist() == list(struct.unpack("<3f", raw[off:off + 12]))


# ---------------------------------------------------------------------------
# Writer: byte-identical round trip


def _stripped(multi):
    """The reference model with every offset/size the writer sets removed."""
    m = mace_pb2.MultiNetDef()
    m.CopyFrom(multi)
    net = m.net_def[0]
    for t in net.tensors:
        t.ClearField("offset")
        t.ClearField("data_size")
    net.ClearField("data_offset")
    net.ClearField("data_size")
    return m


def test_pack_tensors_reproduces_the_reference_data_and_pb(ref):
    multi = _stripped(ref.multi_net_def)
    data = pack_tensors(multi.net_def[0], ref.arrays)
    assert data == (REF / "fmnist_q8.data").read_bytes()
    assert multi.SerializeToString() == (REF / "fmnist_q8.pb").read_bytes()


def test_pack_tensors_fp32_reference():
    fp = read_model(REF / "fmnist_fp32.pb")
    multi = _stripped(fp.multi_net_def)
    assert pack_tensors(multi.net_def[0], fp.arrays) == (REF / "fmnist_fp32.data").read_bytes()
    assert multi.SerializeToString() == (REF / "fmnist_fp32.pb").read_bytes()


def test_alignment_rule():
    """merge_params: non-uint8 tensors start at a multiple of 4; uint8 never padded."""
    net = mace_pb2.NetDef()
    specs = [("a", mace_pb2.DT_UINT8, [3]), ("b", mace_pb2.DT_INT32, [2]),
             ("c", mace_pb2.DT_UINT8, [1]), ("d", mace_pb2.DT_UINT8, [2]),
             ("e", mace_pb2.DT_FLOAT, [1]), ("f", mace_pb2.DT_HALF, [1]),
             ("g", mace_pb2.DT_FLOAT, [1])]
    for name, dt, dims in specs:
        t = net.tensors.add(name=name, data_type=dt)
        t.dims.extend(dims)
    arrays = {"a": np.array([1, 2, 3]), "b": np.array([-1, 7]), "c": np.array([9]),
              "d": np.array([4, 5]), "e": np.array([1.5]), "f": np.array([2.0]),
              "g": np.array([-0.25])}
    data = pack_tensors(net, arrays, data_offset=10)
    offsets = [t.offset for t in net.tensors]
    assert offsets == [0, 4, 12, 13, 16, 20, 24]
    assert [t.data_size for t in net.tensors] == [3, 2, 1, 1 * 2, 1, 1, 1]
    assert net.data_offset == 10 and net.data_size == len(data) == 28
    expected = (bytes([1, 2, 3, 0]) + struct.pack("<2i", -1, 7) + bytes([9, 4, 5, 0])
                + struct.pack("<f", 1.5) + struct.pack("<e", 2.0) + b"\0\0"
                + struct.pack("<f", -0.25))
    assert data == expected
    # And the reader takes the net's data_offset into account.
    back = mace_format.unpack_tensors(net, b"\xff" * 10 + data)
    assert back["b"].tolist() == [-1, 7] and back["f"].dtype == np.float16


def test_pack_tensors_rejects_bad_arrays():
    net = mace_pb2.NetDef()
    t = net.tensors.add(name="w", data_type=mace_pb2.DT_UINT8)
    t.dims.extend([2])
    with pytest.raises(MaceqError, match="'w'.*fit uint8"):
        pack_tensors(net, {"w": np.array([0, 256])})
    with pytest.raises(MaceqError, match="'w'.*not integers"):
        pack_tensors(net, {"w": np.array([0.5, 1.0])})
    with pytest.raises(MaceqError, match=r"'w'.*shape \(3,\)"):
        pack_tensors(net, {"w": np.zeros(3, np.uint8)})
    with pytest.raises(MaceqError, match="'w'.*no array"):
        pack_tensors(net, {})
    with pytest.raises(MaceqError, match="not in net_def.tensors.*'x'"):
        pack_tensors(net, {"w": np.zeros(2, np.uint8), "x": np.zeros(1)})
    # Inline int32_data (MACE's pre-merge form) is moved into the block.
    t.int32_data.extend([3, 250])
    assert pack_tensors(net, {}) == bytes([3, 250]) and len(t.int32_data) == 0


def test_write_model_round_trip_is_byte_identical(ref, tmp_path):
    ranges = read_ranges(REF / "fmnist_ranges.txt")
    meta = {"calibration": {"method": "min_max", "images": 500}, "scales": np.float32(0.5)}
    deployment = {"library_name": "fmnist", "target_abis": ["host"], "platform": "onnx",
                  "runtime": "cpu", "obfuscate": 0}
    before = mace_pb2.MultiNetDef()
    before.CopyFrom(ref.multi_net_def)
    files = write_model(tmp_path, "fmnist_q8", _stripped(ref.multi_net_def), ref.arrays,
                        deployment=deployment, ranges=ranges, maceq=meta)
    assert ref.multi_net_def == before  # the caller's message is untouched
    assert files.pb.read_bytes() == (REF / "fmnist_q8.pb").read_bytes()
    assert files.data.read_bytes() == (REF / "fmnist_q8.data").read_bytes()
    assert files.ranges.read_text() == (REF / "fmnist_ranges.txt").read_text()
    doc = yaml.safe_load(files.yml.read_text())
    assert list(doc) == ["library_name", "target_abis", "model_graph_format",
                         "model_data_format", "models", "maceq"]
    assert doc["library_name"] == "fmnist" and doc["target_abis"] == ["host"]
    assert doc["model_graph_format"] == "file" and doc["model_data_format"] == "file"
    entry = doc["models"]["fmnist_q8"]
    assert entry["model_file_path"] == "./fmnist_q8.pb"
    assert entry["weight_file_path"] == "./fmnist_q8.data"
    assert entry["model_sha256_checksum"] == hashlib.sha256(files.pb.read_bytes()).hexdigest()
    assert entry["weight_sha256_checksum"] == hashlib.sha256(files.data.read_bytes()).hexdigest()
    assert entry["quantize"] == 1 and entry["quantize_range_file"] == "./fmnist_q8_ranges.txt"
    assert entry["runtime"] == "cpu" and entry["platform"] == "onnx" and entry["obfuscate"] == 0
    (sub,) = entry["subgraphs"]
    assert sub == {"input_tensors": ["input"], "input_shapes": ["1,28,28,1"],
                   "input_data_formats": ["NHWC"],
                   "input_ranges": ["-0.8101983666419983,2.022662878036499"],
                   "output_tensors": ["logits"], "output_shapes": ["1,10"],
                   "output_data_formats": ["NONE"]}
    assert doc["maceq"] == {"calibration": {"method": "min_max", "images": 500}, "scales": 0.5}

    back = read_model(files.yml)
    assert back.checksums_verified
    assert back.multi_net_def == ref.multi_net_def
    assert all(np.array_equal(back.arrays[k], v) and back.arrays[k].dtype == v.dtype
               for k, v in ref.arrays.items())
    assert read_ranges(back.files.ranges) == ranges
    via_pb = read_model(files.pb)
    assert via_pb.checksums_verified and via_pb.files.yml == files.yml

    # Deterministic: a second write gives the same bytes.
    again = write_model(tmp_path, "fmnist_q8",
                        _stripped(ref.multi_net_def), ref.arrays, deployment=deployment,
                        ranges=ranges, maceq=meta)
    assert again.yml.read_bytes() == files.yml.read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_write_bare_netdef_and_subgraph_override(ref, tmp_path):
    net = _stripped(ref.multi_net_def).net_def[0]
    sub = {"input_tensors": ["input"], "input_shapes": ["1,1,28,28"],
           "input_data_formats": ["NCHW"], "input_ranges": ["-1.0,2.0"],
           "output_tensors": ["logits"], "output_shapes": ["1,10"],
           "output_data_formats": ["NONE"]}
    files = write_model(tmp_path, "m", net, ref.arrays, deployment={"subgraphs": [sub]})
    assert files.ranges is None
    # Wrapped in a MultiNetDef named after input_info/output_info: the reference bytes.
    assert files.pb.read_bytes() == (REF / "fmnist_q8.pb").read_bytes()
    doc = yaml.safe_load(files.yml.read_text())
    entry = doc["models"]["m"]
    assert entry["subgraphs"] == [sub] and "quantize_range_file" not in entry
    assert doc["library_name"] == "m" and "maceq" not in doc


def test_yml_is_written_last_and_a_failed_write_leaves_no_yml(ref, tmp_path, monkeypatch):
    order = []
    real_replace = os.replace

    def recording_replace(src, dst):
        order.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(mace_format.os, "replace", recording_replace)
    write_model(tmp_path, "m", _stripped(ref.multi_net_def), ref.arrays, deployment={},
                ranges={"input": (-1.0, 1.0)})
    assert order == ["m.data", "m.pb", "m_ranges.txt", "m.yml"]
    assert (tmp_path / "m.yml").exists()

    def failing_replace(src, dst):
        if str(dst).endswith(".pb"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(mace_format.os, "replace", failing_replace)
    with pytest.raises(MaceqError, match=r"m\.pb: cannot write: No space left"):
        write_model(tmp_path, "m", _stripped(ref.multi_net_def), ref.arrays, deployment={})
    assert not (tmp_path / "m.yml").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------
# Reader errors


def _write_copy(tmp_path, ref, name="m"):
    return write_model(tmp_path, name, _stripped(ref.multi_net_def), ref.arrays, deployment={})


def test_truncated_data(ref, tmp_path):
    files = _write_copy(tmp_path, ref)
    data = files.data.read_bytes()
    files.data.write_bytes(data[:-1])
    with pytest.raises(MaceqError, match=r"m\.data: sha256 .* weight_sha256_checksum"):
        read_model(files.yml)
    with pytest.raises(MaceqError, match=r"m\.data: sha256"):
        read_model(files.pb)  # the .yml beside it is read and checked too
    files.yml.unlink()
    with pytest.raises(MaceqError, match=r"m\.data: truncated"):
        read_model(files.pb)
    # A tensor beyond the end, when the net's data_size does not tell.
    multi = mace_pb2.MultiNetDef()
    multi.ParseFromString(files.pb.read_bytes())
    multi.net_def[0].ClearField("data_size")
    files.pb.write_bytes(multi.SerializeToString())
    with pytest.raises(MaceqError, match=r"m\.data: truncated: tensor 'onnx::Conv_270'"):
        read_model(files.pb)


def test_checksum_mismatch_on_pb(ref, tmp_path):
    files = _write_copy(tmp_path, ref)
    doc = yaml.safe_load(files.yml.read_text())
    doc["models"]["m"]["model_sha256_checksum"] = "0" * 64
    files.yml.write_text(yaml.safe_dump(doc))
    with pytest.raises(MaceqError, match=r"m\.pb: sha256 .* model_sha256_checksum in m\.yml"):
        read_model(files.yml)


def test_garbage_and_missing_files(ref, tmp_path):
    files = _write_copy(tmp_path, ref)
    files.yml.unlink()
    for garbage in (b"\xff\xff\xff\xff garbage", b"", b"hello world, not a model",
                    (REF / "fmnist_q8.data").read_bytes()[:500]):
        files.pb.write_bytes(garbage)
        with pytest.raises(MaceqError, match=r"m\.pb: not a MACE model"):
            read_model(files.pb)
    with pytest.raises(MaceqError, match=r"nothere\.pb: no such file"):
        read_model(tmp_path / "nothere.pb")
    (tmp_path / "x.pb").write_bytes((REF / "fmnist_q8.pb").read_bytes())
    with pytest.raises(MaceqError, match=r"x\.data: no such file"):
        read_model(tmp_path / "x.pb")
    (tmp_path / "bad.yml").write_text("models: [unclosed\n")
    with pytest.raises(MaceqError, match=r"bad\.yml: not valid YAML"):
        read_model(tmp_path / "bad.yml")
    (tmp_path / "empty.yml").write_text("library_name: x\n")
    with pytest.raises(MaceqError, match=r"empty\.yml: not a MACE deployment file"):
        read_model(tmp_path / "empty.yml")
    with pytest.raises(MaceqError, match=r"gone\.yml: no such file"):
        read_model(tmp_path / "gone.yml")


def test_bare_netdef_accepted(ref, tmp_path):
    net = ref.multi_net_def.net_def[0]
    (tmp_path / "old.pb").write_bytes(net.SerializeToString())
    (tmp_path / "old.data").write_bytes((REF / "fmnist_q8.data").read_bytes())
    m = read_model(tmp_path / "old.pb")
    assert m.multi_net_def is None and m.net_def == net
    assert np.array_equal(m.arrays["onnx::Conv_212"], ref.arrays["onnx::Conv_212"])


def test_multi_subgraph_refused(ref, tmp_path):
    multi = mace_pb2.MultiNetDef()
    multi.CopyFrom(ref.multi_net_def)
    multi.net_def.add().CopyFrom(multi.net_def[0])
    (tmp_path / "two.pb").write_bytes(multi.SerializeToString())
    (tmp_path / "two.data").write_bytes(b"")
    with pytest.raises(MaceqError, match=r"two\.pb: has 2 subgraphs"):
        read_model(tmp_path / "two.pb")


# ---------------------------------------------------------------------------
# Range file


def test_range_file_round_trip(tmp_path):
    text = (REF / "fmnist_ranges.txt").read_text()
    ranges = read_ranges(REF / "fmnist_ranges.txt")
    assert len(ranges) == len(text.splitlines())
    assert ranges["input"] == (-0.8101983666419983, 2.022662878036499)
    assert ranges["/0/0.2/Clip_output_0"] == (0.0, 6.0)
    out = write_ranges(tmp_path / "r.txt", ranges)
    assert out.read_text() == text


def test_range_file_errors(tmp_path):
    with pytest.raises(MaceqError, match=r"r\.txt:2: expected 'tensor@@min,max'"):
        parse_ranges("a@@0,1\nbroken line\n", source="r.txt")
    with pytest.raises(MaceqError, match=r"r\.txt:1: tensor 'a': bad range"):
        parse_ranges("a@@2,1\n", source="r.txt")
    with pytest.raises(MaceqError, match=r"r\.txt:2: tensor 'a' appears twice"):
        parse_ranges("a@@0,1\na@@0,2\n", source="r.txt")
    with pytest.raises(MaceqError, match="cannot be written"):
        write_ranges(tmp_path / "r.txt", {"a@@b": (0.0, 1.0)})
    assert parse_ranges("x@@-1e-3, 4\n\n") == {"x": (-0.001, 4.0)}


# ---------------------------------------------------------------------------
# Argument helpers


def test_add_arg_and_get_arg_match_the_reference_encoding(ref):
    op = mace_pb2.OperatorDef(name="c", type="Conv2D")
    for name, value in [("T", 2), ("framework_type", 2), ("data_format", 1000),
                        ("strides", [1, 1]), ("kernels", [3, 3]), ("padding_values", [2, 2]),
                        ("group", 1), ("dilations", [1, 1]), ("activation", "RELUX"),
                        ("max_limit", 6.0)]:
        add_arg(op, name, value)
    assert list(op.arg) == list(ref.net_def.op[1].arg)
    assert get_arg(op, "strides") == [1, 1] and get_arg(op, "nope", None) is None
    with pytest.raises(MaceqError, match="c: no arg 'nope'"):
        get_arg(op, "nope")


# ---------------------------------------------------------------------------
# The quantization parameters MACE's converter wrote (documented in
# docs/mace-format.md), reproduced from the range file and the ONNX weights.


def _adjust_range(in_min: float, in_max: float, *, non_zero: bool):
    """Transcription of tools/python/quantize/quantize_util.py adjust_range (CPU)."""
    out_max = max(0.0, in_max)
    out_min = min(0.0, in_min)
    if non_zero:
        out_min = min(out_min, in_min - (out_max - in_min) / 254.0)
    scale = (out_max - out_min) / 255.0
    eps = 1e-6
    if out_min < -eps and out_max > eps:
        zero = -out_min / scale
        zero_int = int(round(zero))
        if abs(zero - zero_int) > eps and non_zero:
            zero_int = int(math.ceil(zero))
    elif out_min > -eps:
        zero_int = 0
    else:
        zero_int = 255
    return scale, zero_int, -zero_int * scale, (255 - zero_int) * scale


def test_reference_quantization_parameters_follow_the_documented_rules(ref):
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper

    weights = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(ONNX_MODEL)).graph.initializer}
    ranges = read_ranges(REF / "fmnist_ranges.txt")
    net = ref.net_def
    tensors = {t.name: t for t in net.tensors}
    act: dict[str, tuple] = {}
    mismatches = 0
    for op in net.op:
        for out, info in zip(op.output, op.quantize_info):
            got = (info.scale, info.zero_point, info.minval, info.maxval)
            if op.type == "Reduce":  # copies its producer's info
                want = act[op.input[0]]
            else:
                key = op.input[0] if op.type == "Quantize" else out.removeprefix("mace_output_node_")
                s, z, lo, hi = _adjust_range(*ranges[key], non_zero=False)
                want = (_f32(s), z, _f32(lo), _f32(hi))
            act[out] = want
            mismatches += want != got
    assert len(act) == 26 and mismatches == 0

    code_mismatches = 0
    for op in net.op:
        if len(op.input) != 3:
            continue
        w, b = tensors[op.input[1]], tensors[op.input[2]]
        wf = weights[w.name].astype(np.float64)
        s, z, lo, hi = _adjust_range(float(wf.min()), float(wf.max()), non_zero=True)
        assert (w.scale, w.zero_point, w.minval, w.maxval) == (_f32(s), z, _f32(lo), _f32(hi))
        if op.type == "Conv2D":
            wf = wf.transpose(0, 2, 3, 1)
        elif op.type == "DepthwiseConv2d":
            wf = wf.transpose(2, 3, 0, 1)
        else:
            wf = wf.reshape(wf.shape[0], 1, 1, -1)
        codes = np.clip(np.round(z + wf / s).astype(np.int32), 0, 255)  # float64 scale
        code_mismatches += int((codes != ref.arrays[w.name]).sum())
        bias_scale = float(np.float32(act[op.input[0]][0])) * float(w.scale)  # f32*f32 in f64
        assert b.scale == _f32(bias_scale) and b.zero_point == 0
        assert b.minval == 0.0 and b.maxval == 0.0 and b.quantized
        bias = np.round(weights[b.name].astype(np.float64) / bias_scale).astype(np.int32)
        code_mismatches += int((bias != ref.arrays[b.name]).sum())
    assert code_mismatches == 0
