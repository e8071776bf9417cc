"""Vector loops written in LLVM IR (numba intrinsics) where LLVM's loop vectorizer does not find the form that keeps
the data in registers.

**3x3 depthwise sums** (:func:`dw3x3_blocks`, from compiled code only). For one output row of a depthwise
convolution whose padded input rows r0, r1, r2 (the rows ky = 0, 1, 2 read, each [WP, C] flat) and offset filter
wk [3, 3, C] are float32, and whose accumulators acc [OW, C] are float32::

    acc[ox, c] = sum over ky, kx of r_ky[ox*sw + kx*dw, c] * wk[ky, kx, c]

The compiled loop with the channels innermost (runtime/kernels/jit.py ``_dw_ring_sums``) loads the nine weights
again for every output column: 18 loads for 8 outputs, which bounds it by the loads (0.5-0.9 ns an output on the
project's AVX2 hosts). Here a block of 8 channels is one ``<8 x float>`` vector: its nine weight vectors are loaded
once and stay in registers while the loop runs over the output columns, each column nine input loads and nine
multiply-adds (``llvm.fmuladd``: fused where the CPU has FMA). The channels past the last multiple of 8 are left to
the caller.

Exactness: the caller uses float32 accumulators only where every partial sum of the taps, in any order, is an
integer below 2^24 (runtime/kernels/conv.py, argument 3), so every product and sum here is exact, fused or not, and
equals the scalar loop's. tests/test_fast_paths.py compares whole depthwise convolutions with the reference kernel
and counts the blocks run here.
"""
from __future__ import annotations

try:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, overload
except ImportError:  # pragma: no cover - exercised only without numba
    intrinsic = None

__all__ = ["LANES", "dw3x3_blocks"]

LANES = 8  # float32 lanes of one vector: a block of channels


def dw3x3_blocks(r0, r1, r2, sw, dw, wk, acc):
    """acc[:, :C8] = the 3x3 depthwise sums (module docstring) of the first C8 = 8*floor(C/8) channels, for
    float32 rows, filter and accumulators (flat arrays: rows [WP*C], wk [9*C], acc [OW*C]); returns C8, the
    channels done (0 for other types, which the caller then sums itself). Compiled code only."""
    raise NotImplementedError("compiled code only")


if intrinsic is not None:
    def _no_unroll(module):
        """The loop metadata ``!{!self, !{"llvm.loop.unroll.disable"}}``: unrolled, the loop's nine input pointers
        per copy left the registers and every load reloaded its pointer from the stack."""
        flag = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
        node = module.add_metadata([flag, flag])  # the first operand becomes the node itself (a loop ID)
        node.operands = (node, flag)
        return node

    def _dw3x3_ir(context, builder, signature, args):
        """One block of 8 channels over n output columns: nine weight vectors loaded before the loop, then per
        column nine input vectors, a chain of three multiply-adds per kernel row, the three rows' sums added
        (ky 0 + ky 1, then + ky 2) and one store; the loop is not unrolled (_no_unroll)."""
        i64 = ir.IntType(64)
        vec = ir.VectorType(ir.FloatType(), LANES)
        arrays = {0, 1, 2, 6, 9}
        vals = [v if i in arrays else context.cast(builder, v, signature.args[i], types.int64)
                for i, v in enumerate(args)]
        r0, r1, r2, x_off, x_step, x_tap, w, w_off, w_tap, acc, a_off, a_step, n = vals

        def data(i, v):
            return context.make_array(signature.args[i])(context, builder, v).data

        rows = [data(0, r0), data(1, r1), data(2, r2)]
        pw, pa = data(6, w), data(9, acc)
        fmuladd = builder.module.declare_intrinsic(f"llvm.fmuladd.v{LANES}f32", fnty=ir.FunctionType(vec, [vec] * 3))

        def vload(ptr, index):
            return builder.load(builder.bitcast(builder.gep(ptr, [index]), vec.as_pointer()), align=4)

        weights = [vload(pw, builder.add(w_off, builder.mul(ir.Constant(i64, t), w_tap))) for t in range(9)]
        entry = builder.basic_block
        loop, done = builder.append_basic_block("dw_loop"), builder.append_basic_block("dw_done")
        builder.cbranch(builder.icmp_signed(">", n, ir.Constant(i64, 0)), loop, done)
        builder.position_at_end(loop)
        i = builder.phi(i64)
        i.add_incoming(ir.Constant(i64, 0), entry)
        base = builder.add(x_off, builder.mul(i, x_step))
        row_sums = []
        for ky in range(3):  # one chain of three multiply-adds per kernel row: three chains in flight
            part = None
            for kx in range(3):
                v = vload(rows[ky], builder.add(base, builder.mul(ir.Constant(i64, kx), x_tap)))
                w_t = weights[3 * ky + kx]
                part = builder.fmul(v, w_t) if part is None else builder.call(fmuladd, [v, w_t, part])
            row_sums.append(part)
        total = builder.fadd(builder.fadd(row_sums[0], row_sums[1]), row_sums[2])
        out = builder.gep(pa, [builder.add(a_off, builder.mul(i, a_step))])
        builder.store(total, builder.bitcast(out, vec.as_pointer()), align=4)
        i_next = builder.add(i, ir.Constant(i64, 1))
        i.add_incoming(i_next, loop)
        back = builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
        back.set_metadata("llvm.loop", _no_unroll(builder.module))
        builder.position_at_end(done)
        return context.get_dummy_value()

    @intrinsic
    def _dw3x3_block(typingctx, r0, r1, r2, x_off, x_step, x_tap, w, w_off, w_tap, acc, a_off, a_step, n):
        """acc[a_off + i*a_step + l] = sum over ky, kx of r_ky[x_off + i*x_step + kx*x_tap + l] *
        w[w_off + (3*ky + kx)*w_tap + l], for i < n and l < 8 (flat float32 arrays, offsets in elements)."""
        arrays = (r0, r1, r2, w, acc)
        if not all(isinstance(a, types.Array) and a.dtype == types.float32 for a in arrays):
            return None
        sig = types.void(r0, r1, r2, x_off, x_step, x_tap, w, w_off, w_tap, acc, a_off, a_step, n)
        return sig, _dw3x3_ir

    @overload(dw3x3_blocks, jit_options=dict(nogil=True, boundscheck=False, error_model="numpy"))
    def _dw3x3_blocks_typed(r0, r1, r2, sw, dw, wk, acc):
        if not all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (r0, r1, r2, wk, acc)):
            return lambda r0, r1, r2, sw, dw, wk, acc: 0

        def impl(r0, r1, r2, sw, dw, wk, acc):
            c = wk.shape[0] // 9
            c8 = c - c % LANES
            ow = acc.shape[0] // c
            for cb in range(0, c8, LANES):
                _dw3x3_block(r0, r1, r2, cb, sw * c, dw * c, wk, cb, c, acc, cb, c, ow)
            return c8
        return impl
