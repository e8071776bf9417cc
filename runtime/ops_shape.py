"""Shape-only ops (views): the codes pass through unchanged, with their quantization.

MACE's converter folds Flatten/Reshape before a FullyConnected into the FC
(maceq's writer does the same), so these appear only in models from other
writers. The target shape comes from the op's ``output_shape`` (NHWC for 4-D),
with the batch taken from the input.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maceq.errors import MaceqError
from maceq.mace.enums import ResizeCoordinateMode
from maceq.runtime.graph import RtOp
from maceq.runtime.kernel import Kernel
from maceq.runtime.kernels.resize import resize_bilinear_mace
from maceq.runtime.qtypes import QTensor
from maceq.runtime.registry import register


@dataclass(frozen=True)
class ViewParams:
    tail: tuple[int, ...]  # the output shape without its batch dimension


class _View(Kernel):
    def prepare(self, op: RtOp, in_q, ctx) -> ViewParams:
        if not op.output_shapes:
            raise MaceqError(f"op '{op.name}' ({op.type}): no output_shape to reshape to")
        return ViewParams(tuple(int(d) for d in op.output_shapes[0][1:]))

    def run(self, prepared, inputs):
        p = prepared.params
        x = inputs[0]
        n = x.values.shape[0]
        if int(np.prod(p.tail)) * n != x.values.size:
            raise MaceqError(f"{type(self).__name__}: cannot view {x.values.shape} as (N,) + {p.tail}")
        return [QTensor(x.values.reshape((n,) + p.tail), x.qinfo)]


@register("Reshape")
class Reshape(_View):
    pass


@register("Squeeze")
class Squeeze(_View):
    pass


@register("Flatten")
class Flatten(_View):
    pass


@dataclass(frozen=True)
class ResizeParams:
    out_hw: tuple[int, int]
    align_corners: bool
    coordinate_mode: ResizeCoordinateMode
    scale_hw: tuple[np.float32, np.float32] | None  # MACE's height/width scale args


@register("ResizeBilinear")
class ResizeBilinear(Kernel):
    """MACE's uint8 ResizeBilinear (mace/ops/resize_bilinear.cc): codes interpolated in float32, roundf.

    The output keeps the input's scale and zero point, as MACE's converter writes it.
    """

    def prepare(self, op: RtOp, in_q, ctx) -> ResizeParams:
        size = op.arg("size")
        hs, ws = op.arg("height_scale"), op.arg("width_scale")
        if size is None and hs is None:
            raise MaceqError(f"op '{op.name}' (ResizeBilinear): neither size nor scale args")
        scale_hw = None
        if hs is not None and ws is not None:
            scale_hw = (np.float32(hs), np.float32(ws))
        mode = int(op.arg("coordinate_transformation_mode", ResizeCoordinateMode.NONE))
        if mode not in tuple(ResizeCoordinateMode):
            raise MaceqError(f"op '{op.name}' (ResizeBilinear): unknown coordinate_transformation_mode {mode}")
        out_hw = tuple(size) if size is not None else tuple(op.output_shapes[0][1:3])
        return ResizeParams(out_hw, bool(op.arg("align_corners", 0)), ResizeCoordinateMode(mode), scale_hw)

    def run(self, prepared, inputs):
        p = prepared.params
        scale_hw = None if p.scale_hw is None else tuple(float(s) for s in p.scale_hw)
        y = resize_bilinear_mace(inputs[0].values, out_hw=None if scale_hw else p.out_hw, scale_hw=scale_hw,
                                 align_corners=p.align_corners, coordinate_mode=ResizeCoordinateMode(int(p.coordinate_mode)))
        return [QTensor(y, inputs[0].qinfo)]
