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
from maceq.runtime.graph import RtOp
from maceq.runtime.registry import register


@dataclass(frozen=True)
class ViewParams:
    tail: tuple[int, ...]  # the output shape without its batch dimension


class _View:
    def prepare(self, op: RtOp, in_q, ctx) -> ViewParams:
        if not op.output_shapes:
            raise MaceqError(f"op '{op.name}' ({op.type}): no output_shape to reshape to")
        return ViewParams(tuple(int(d) for d in op.output_shapes[0][1:]))

    def run(self, p: ViewParams, inputs):
        from maceq.runtime.model import QTensor

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
