"""The runtime's view of a MACE NetDef: ops with decoded arguments, in execution order."""
from __future__ import annotations

from dataclasses import dataclass, field

from maceq.errors import MaceqError
from maceq.runtime.qtypes import QInfo


@dataclass(frozen=True)
class RtOp:
    name: str
    type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    args: dict = field(hash=False)
    out_qinfo: tuple[QInfo, ...]
    output_shapes: tuple[tuple[int, ...], ...]

    def arg(self, key, default=None):
        return self.args.get(key, default)

    def require(self, key):
        if key not in self.args:
            raise MaceqError(f"op '{self.name}' ({self.type}): missing argument '{key}'")
        return self.args[key]


def _decode_arg(a):
    if len(a.ints):
        return [int(v) for v in a.ints]
    if len(a.floats):
        return [float(v) for v in a.floats]
    if a.HasField("s"):
        return a.s.decode("utf-8", "replace")
    if a.HasField("f"):
        return float(a.f)
    if a.HasField("i"):
        return int(a.i)
    return None


def parse_ops(net_def) -> list[RtOp]:
    ops = []
    for op in net_def.op:
        args = {a.name: _decode_arg(a) for a in op.arg}
        q = tuple(QInfo(float(qi.scale), int(qi.zero_point), float(qi.minval), float(qi.maxval))
                  for qi in op.quantize_info)
        shapes = tuple(tuple(int(d) for d in s.dims) for s in op.output_shape)
        ops.append(RtOp(op.name, op.type, tuple(op.input), tuple(op.output), args, q, shapes))
    return toposort(ops, available={i.name for i in net_def.input_info} | {t.name for t in net_def.tensors})


def toposort(ops: list[RtOp], *, available: set[str]) -> list[RtOp]:
    done = set(available)
    order, pending = [], list(ops)
    while pending:
        rest = [op for op in pending if not all(i in done for i in op.inputs)]
        ready = [op for op in pending if all(i in done for i in op.inputs)]
        if not ready:
            op = rest[0]
            missing = [i for i in op.inputs if i not in done]
            raise MaceqError(f"op '{op.name}' ({op.type}): input '{missing[0]}' is never produced (or the graph has a cycle)")
        for op in ready:
            order.append(op)
            done.update(op.outputs)
        pending = rest
    return order
