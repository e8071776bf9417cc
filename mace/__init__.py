"""The MACE model format: schema (mace.proto / mace_pb2), writer and reader.

See docs/mace-format.md for the conventions MACE's converter follows.
"""
from maceq.mace import mace_pb2
from maceq.mace.format import (
    DATA_FORMAT_NAMES,
    LoadedModel,
    ModelFiles,
    add_arg,
    dump_text,
    format_ranges,
    get_arg,
    numpy_dtype,
    pack_tensors,
    parse_model_proto,
    parse_ranges,
    read_model,
    read_ranges,
    sha256_hex,
    unpack_tensors,
    write_model,
    write_ranges,
)

__all__ = [
    "mace_pb2", "DATA_FORMAT_NAMES", "LoadedModel", "ModelFiles", "add_arg", "dump_text",
    "format_ranges", "get_arg", "numpy_dtype", "pack_tensors", "parse_model_proto",
    "parse_ranges", "read_model", "read_ranges", "sha256_hex", "unpack_tensors",
    "write_model", "write_ranges",
]
