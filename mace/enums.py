"""MACE's enum values, once: what the integers in a NetDef's fields and arguments mean.

Sources (XiaoMi/mace): ``mace/proto/mace.proto`` (DataType), ``include/mace/public/mace.h`` (DataFormat),
``mace/ops/common/conv_pool_2d_util.h`` (Padding), ``mace/ops/common/{pooling,eltwise,reduce}_type.h``,
``mace/core/types.h`` (FrameworkType), ``mace/ops/common/coordinate_transformation_mode.h``. The writer stores these values; the reader and
the runtime compare against them. ``int(member)`` is the stored value.
"""
from __future__ import annotations

from enum import IntEnum

from maceq.mace import mace_pb2


class DataType(IntEnum):
    """``mace.DataType``: a tensor's storage type, and an op's ``T`` argument."""

    DT_INVALID = mace_pb2.DT_INVALID
    DT_FLOAT = mace_pb2.DT_FLOAT
    DT_UINT8 = mace_pb2.DT_UINT8
    DT_HALF = mace_pb2.DT_HALF
    DT_INT32 = mace_pb2.DT_INT32
    DT_FLOAT16 = mace_pb2.DT_FLOAT16
    DT_BFLOAT16 = mace_pb2.DT_BFLOAT16
    DT_INT16 = mace_pb2.DT_INT16
    DT_INT8 = mace_pb2.DT_INT8


class DataFormat(IntEnum):
    """``mace::DataFormat``: an op's ``data_format`` argument, a tensor's ``data_format`` field and the
    net's ``filter_format`` argument."""

    NONE = 0
    NHWC = 1
    NCHW = 2
    HWOI = 100
    OIHW = 101
    HWIO = 102
    OHWI = 103
    AUTO = 1000


class Padding(IntEnum):
    """``mace::Padding``: an op's ``padding`` argument (when ``padding_values`` is absent)."""

    VALID = 0
    SAME = 1
    FULL = 2


class PoolingType(IntEnum):
    """``mace::PoolingType``: the Pooling op's ``pooling_type`` argument."""

    AVG = 1
    MAX = 2


class EltwiseType(IntEnum):
    """``mace::ops::EltwiseType``: the Eltwise op's ``type`` argument."""

    SUM = 0
    SUB = 1
    PROD = 2
    DIV = 3
    MIN = 4
    MAX = 5
    NEG = 6
    ABS = 7
    SQR_DIFF = 8
    POW = 9
    EQUAL = 10
    FLOOR_DIV = 11
    CLIP = 12
    SIGN = 13
    NONE = 14
    NOT_EQUAL = 15


class ReduceType(IntEnum):
    """``mace::ReduceType``: the Reduce op's ``reduce_type`` argument."""

    MEAN = 0
    MIN = 1
    MAX = 2
    PROD = 3
    SUM = 4


class FrameworkType(IntEnum):
    """``mace::FrameworkType``: the net's ``framework_type`` argument."""

    TENSORFLOW = 0
    CAFFE = 1
    ONNX = 2
    MEGENGINE = 3
    KERAS = 4


class ResizeCoordinateMode(IntEnum):
    """``mace::ops::common::CoordinateTransformationMode``: ResizeBilinear's
    ``coordinate_transformation_mode`` argument."""

    NONE = 0
    HALF_PIXEL = 1
    PYTORCH_HALF_PIXEL = 2


__all__ = ["DataFormat", "DataType", "EltwiseType", "FrameworkType", "Padding", "PoolingType", "ReduceType",
           "ResizeCoordinateMode"]
