"""Exact integer GEMMs on x86 SIMD: uint8 activations times a convolution's offset filter, int32 sums per tile.

The offset filter is w' = w - w_zp (|w'| <= 255); for codes x (zero point zx) of one output pixel the tiles give
``G = sum (x - zx) * w'`` exactly, in int64, in one of two forms, the better one the CPU has (``isa``):

**AVX-512 VNNI.** ``vpdpbusd`` adds to each of 16 int32 lanes the four products of unsigned bytes of one operand
and signed bytes of the other, without saturation: every sum of K products of |u| <= 255 and |s| <= 128 is exact
while K * 255 * 128 < 2^31 (K < 65,793). One instruction does 64 multiply-adds, four times a float32 FMA's 16, and
the activations need no conversion. Each channel's w' (its values within 255 of each other) is stored as int8
s = w' + t, with t = -128 - min(w'); then ``G = sum x * s - t * sum x - zx * sum w'``: ``P = sum x * s`` comes from
the tiles, ``sum x`` per row and ``sum w'`` per channel are integer sums. Layout: s as [K/4, N16, 4] bytes (N16: N
rounded up to 16; the padding columns are 0), so that one 64-byte load is four consecutive k of 16 channels; K a
multiple of 4. A tile is 4 rows of x (``lda`` bytes apart) times 16 * nv channels (nv = 1..4).

**AVX2.** ``vpmaddwd`` multiplies pairs of int16 and adds each pair into an int32 lane: 16 multiply-adds per
256-bit instruction, twice a float32 FMA's 8. The activations are centered and converted per 4 rows (x - zx, an
int16 in [-255, 255]; K padded to even with a zero), w' is stored as int16 pairs [K/2, N16, 2], and each tile's sum
is G itself, exact while K * 255 * 255 < 2^31 (K <= 33,025). A tile is 4 rows times 16 channels (two 256-bit
vectors).

In both, a tile's sums stay in registers over all of K and are stored once; the tiles are LLVM IR written through a
numba intrinsic (``llvm.x86.avx512.vpdpbusd.512``, ``llvm.x86.avx2.pmadd.wd``), so they exist only where the CPU
has the instructions and numba compiles for it (``isa``). Equal to int64 sums: tests/test_intgemm.py.

Users: the cpu's 1x1 convolutions (``pointwise_conv``, with its float64 requantization), the gpu's convolutions
and FullyConnected on im2col rows (``gpu_pointwise`` / ``GpuPointwiseCall``, with its float32 requantization) and
nnlib's convolution and SuperFC sums (``pointwise_sums``, ``dsp_pointwise``); each falls back to its float32-GEMM
path where the tiles do not apply. A FullyConnected of 1-3 rows takes jit.fc_sums instead.
"""
from __future__ import annotations

import enum
import functools
import os

import numpy as np

from maceq.runtime import threads
from maceq.runtime.kernels import jit
from maceq.runtime.kernels.derived import derived

try:
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic, overload
except ImportError:  # pragma: no cover - exercised only without numba
    intrinsic = None

__all__ = ["Isa", "isa", "available", "supported", "PackedFilter", "pack_filter", "packed", "pointwise_sums",
           "pointwise_conv", "PointwiseCall", "gpu_pointwise", "GpuPointwiseCall", "dsp_pointwise"]

ROWS = 4  # rows of x per tile
CHUNK_ROWS = 64  # AVX2: rows of x converted to int16 at a time (64 x K int16: 128 KiB at K = 1,024)
PANEL_GROUP_BYTES = 96 << 10  # AVX2: the weights of the 16-channel panels one pass over a chunk's tiles reads


class Isa(enum.Enum):
    """The instruction set a packed filter's tiles run on."""

    VNNI = "avx512-vnni"
    AVX2 = "avx2"


#: The longest reduction whose int32 lane sums stay exact: K * 255 * 128 < 2^31 (VNNI), K * 255 * 255 < 2^31 (AVX2).
MAX_TERMS = {Isa.VNNI: 65_792, Isa.AVX2: 33_025}


@functools.lru_cache(maxsize=1)
def _host_features() -> dict:
    try:
        import llvmlite.binding as ll

        return dict(ll.get_host_cpu_features())
    except Exception:  # pragma: no cover - no llvmlite, or a host it cannot describe
        return {}


def _numba_targets_host() -> bool:
    """numba compiles for this CPU (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES unset): a portable target such as
    ``generic`` has neither instruction set, and LLVM cannot lower the tiles' instructions for it."""
    from numba.core import config

    return config.CPU_NAME in (None, "host") and not config.CPU_FEATURES


def supported() -> tuple[Isa, ...]:
    """The instruction sets whose tiles can run here, the better first: the compiled loops are on, numba compiles
    for this CPU, the CPU has them, and ``MACEQ_NO_INTGEMM`` is unset (read once per model run, threads.run_memo,
    and on every call outside one; the answer remembered per setting)."""
    memo = threads.run_memo()
    hit = None if memo is None else memo.get("intgemm")
    if hit is None:
        from numba.core import config

        env = os.environ
        hit = _supported(env.get("MACEQ_NO_INTGEMM", ""), env.get("MACEQ_NO_JIT", ""), config.CPU_NAME,
                         config.CPU_FEATURES)
        if memo is not None:
            memo["intgemm"] = hit
    return hit


@functools.lru_cache(maxsize=16)
def _supported(no_intgemm: str, no_jit: str, cpu_name, cpu_features) -> tuple[Isa, ...]:
    if no_intgemm not in ("", "0") or intrinsic is None or not jit.available() or not _numba_targets_host():
        return ()
    f = _host_features()
    return tuple(i for i, ok in ((Isa.VNNI, f.get("avx512f") and f.get("avx512vnni")), (Isa.AVX2, f.get("avx2")))
                 if ok)


def isa() -> Isa | None:
    """The instruction set the tiles use here (the first of ``supported``), or None: the float32-GEMM paths run."""
    have = supported()
    return have[0] if have else None


def available() -> bool:
    """True when the tiles can run here (``isa`` is not None)."""
    return isa() is not None


class PackedFilter:
    """An offset filter w' [O, K] in the tiles' form for ``isa``: ``data`` (VNNI: int8 [K/4, n16, 4]; AVX2: int16
    [K'/2, n16, 2], K' = K rounded up to even; flattened), ``n16``, and per channel ``shift`` (t; 0 for AVX2) and
    ``sums`` (sum w'), both int64."""

    def __init__(self, wo: np.ndarray, isa: Isa):
        wo = np.asarray(wo, dtype=np.int64)
        o, k = wo.shape
        limit = MAX_TERMS[isa]
        if isa is Isa.VNNI and (k < 4 or k % 4 or k > limit):  # a tile runs at least one step of 4
            raise ValueError(f"PackedFilter: K={k} must be a positive multiple of 4 up to {limit}")
        if not 1 <= k <= limit:
            raise ValueError(f"PackedFilter: K={k} must be between 1 and {limit}")
        self.k, self.o, self.isa = k, o, isa
        self.n16 = -(-o // 16) * 16
        self.sums = wo.sum(axis=1)
        if isa is Isa.AVX2:
            if o and int(np.abs(wo).max()) > 255:
                raise ValueError("PackedFilter: the values must lie in [-255, 255]")
            self.shift = np.zeros(o, np.int64)
            kp = k + k % 2
            s = np.zeros((kp, self.n16), np.int16)
            s[:k, :o] = wo.T
            self.data = np.ascontiguousarray(s.reshape(kp // 2, 2, self.n16).transpose(0, 2, 1)).reshape(-1)
            return
        lo = wo.min(axis=1)
        if o and int((wo.max(axis=1) - lo).max()) > 255:
            raise ValueError("PackedFilter: each channel's values must lie within 255 of each other")
        self.shift = -128 - lo
        s = np.zeros((k // 4, self.n16, 4), np.int8)
        s[:, :o, :] = (wo + self.shift[:, None]).T.reshape(k // 4, 4, o).transpose(0, 2, 1)
        self.data = s.reshape(-1)


#: Below this many filter entries (K * O) a tile's fixed costs (its stores, the row sums or conversions, the
#: corrections per output) outweigh its multiply-adds. VNNI (Xeon, Sapphire Rapids), on MobileNetV2's 1x1 layers:
#: K=32, O=16 and K=16, O=96 ran 15-20% slower than the float32 GEMM path, K=96, O=24 as fast, K=24, O=144 and
#: larger 1.4-3x faster. AVX2 (EPYC, Zen 3): MobileNetV2's smallest filters ran as fast or faster on the tiles
#: (fastest of 27 runs, three processes each: K=27, O=32 0.79-0.88 ms against 0.97-1.09; K=32, O=16 0.22-0.25 ms
#: against 0.29-0.34; K=16, O=96 0.58-0.64 ms against 0.61-0.72).
MIN_ENTRIES = {Isa.VNNI: 2048, Isa.AVX2: 0}


def pack_filter(wo: np.ndarray, isa: Isa) -> PackedFilter | None:
    """The form of the offset filter ``wo`` [O, K] for ``isa``, or None where the tiles do not pay (fewer than
    MIN_ENTRIES entries) or do not apply (K too long or, for VNNI, not a multiple of 4; values out of range)."""
    wo = np.asarray(wo)
    if wo.size < MIN_ENTRIES[isa]:
        return None
    try:
        return PackedFilter(wo, isa)
    except ValueError:
        return None


def packed(src: np.ndarray, key, offset_filter) -> PackedFilter | None:
    """The packed form of ``offset_filter(src)`` (an offset filter [O, K]) for this CPU's ``isa``, made once per
    live array ``src``, ``key`` and instruction set (runtime/kernels/derived.py); None where the tiles do not run
    or do not apply."""
    use = isa()
    if use is None:
        return None
    return derived(src, ("intgemm", use, key), lambda v: (pack_filter(offset_filter(v), use),))[0]


if intrinsic is not None:
    def _make_tile(kind: Isa, nv: int):
        """The intrinsic ``tile(a, a_off, lda, b, b_off, b_stride, c, c_off, ldc, steps)``: int32 c[r, 16v + j] for
        r < 4, v < nv = the sum over ``steps`` steps of a's row r times b's channel (VNNI: uint8 a, int8 b, 4 k a
        step; AVX2: int16 a and b, 2 k a step); offsets and strides are in elements."""
        a_dtype, b_dtype = (types.uint8, types.int8) if kind is Isa.VNNI else (types.int16, types.int16)

        @intrinsic
        def tile(typingctx, a, a_off, lda, b, b_off, b_stride, c, c_off, ldc, steps):
            if not (isinstance(a, types.Array) and a.dtype == a_dtype and isinstance(b, types.Array)
                    and b.dtype == b_dtype and isinstance(c, types.Array) and c.dtype == types.int32):
                return None
            sig = types.void(a, a_off, lda, b, b_off, b_stride, c, c_off, ldc, steps)

            def codegen(context, builder, signature, args):
                return _tile_ir(context, builder, signature, args, kind, nv)

            return sig, codegen

        return tile

    def _dot(builder, kind: Isa):
        """``dot(acc, a, b)``: acc plus the step's products, one instruction (VNNI) or two (AVX2)."""
        i32 = ir.IntType(32)
        if kind is Isa.VNNI:
            v16 = ir.VectorType(i32, 16)
            fn = builder.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(v16, [v16] * 3))
            return lambda acc, a, b: builder.call(fn, [acc, a, b])
        v8, v16s = ir.VectorType(i32, 8), ir.VectorType(ir.IntType(16), 16)
        fn = builder.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(v8, [v16s, v16s]))
        return lambda acc, a, b: builder.add(acc, builder.call(fn, [builder.bitcast(v, v16s) for v in (a, b)]))

    def _tile_ir(context, builder, signature, args, kind, nv):
        """The tile's loop over its steps: 4*nv accumulators (phi nodes), nv filter loads and 4 broadcast
        activation words (4 bytes of k, or 2 int16) per step, 4*nv dot steps; the accumulators stored once."""
        i32, i64 = ir.IntType(32), ir.IntType(64)
        lanes, width = (16, 8) if kind is Isa.VNNI else (8, 16)  # int32 lanes per vector, bits per element
        vec, ep = ir.VectorType(i32, lanes), ir.IntType(width).as_pointer()
        per_step = 32 // width  # elements of a (and of b per channel) in one step
        a_arr, a_off, lda, b_arr, b_off, b_stride, c_arr, c_off, ldc, steps = (
            context.cast(builder, v, t, types.int64) if isinstance(t, types.Integer) else v
            for v, t in zip(args, signature.args))

        def base(i, v, ptr):
            return builder.bitcast(context.make_array(signature.args[i])(context, builder, v).data, ptr)

        pa, pb = builder.gep(base(0, a_arr, ep), [a_off]), builder.gep(base(3, b_arr, ep), [b_off])
        pc = builder.gep(base(6, c_arr, i32.as_pointer()), [c_off])
        dot = _dot(builder, kind)
        entry = builder.basic_block
        loop, done = builder.append_basic_block("tile_loop"), builder.append_basic_block("tile_done")
        builder.branch(loop)
        builder.position_at_end(loop)
        k = builder.phi(i64)
        k.add_incoming(ir.Constant(i64, 0), entry)
        accs = [builder.phi(vec) for _ in range(ROWS * nv)]
        for acc in accs:
            acc.add_incoming(ir.Constant(vec, None), entry)
        step = builder.mul(k, b_stride)
        panel = lanes * per_step  # elements of b per vector in one step
        bvec = [builder.load(builder.bitcast(builder.gep(pb, [builder.add(step, ir.Constant(i64, panel * v))]),
                                             vec.as_pointer()), align=1) for v in range(nv)]
        new = []
        for r in range(ROWS):
            row = builder.add(builder.mul(ir.Constant(i64, r), lda), builder.mul(k, ir.Constant(i64, per_step)))
            word = builder.load(builder.bitcast(builder.gep(pa, [row]), i32.as_pointer()), align=1)
            av = builder.insert_element(ir.Constant(vec, ir.Undefined), word, ir.Constant(i32, 0))
            av = builder.shuffle_vector(av, ir.Constant(vec, ir.Undefined), ir.Constant(vec, None))
            new += [dot(accs[r * nv + v], av, bvec[v]) for v in range(nv)]
        k_next = builder.add(k, ir.Constant(i64, 1))
        for acc, value in zip(accs, new):
            acc.add_incoming(value, loop)
        k.add_incoming(k_next, loop)
        builder.cbranch(builder.icmp_signed("<", k_next, steps), loop, done)
        builder.position_at_end(done)
        for r in range(ROWS):
            for v in range(nv):
                p = builder.gep(pc, [builder.add(builder.mul(ir.Constant(i64, r), ldc), ir.Constant(i64, lanes * v))])
                builder.store(new[r * nv + v], builder.bitcast(p, vec.as_pointer()), align=1)
        return context.get_dummy_value()

    _tile1, _tile2, _tile3, _tile4 = (_make_tile(Isa.VNNI, nv) for nv in (1, 2, 3, 4))
    _tile16 = _make_tile(Isa.AVX2, 2)  # 16 channels: two 256-bit vectors, 8 accumulators

    _jit = njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
    _pjit = njit(cache=True, nogil=True, boundscheck=False, error_model="numpy", parallel=True)

    @_jit
    def _tiles(a, a_off, lda, b, n16, c, k4):
        """VNNI: c[:4, :n16] = the 4 rows of a at a_off (lda apart) times the packed filter b, panel by panel."""
        b_stride = np.int64(n16 * 4)
        n0 = 0
        while n16 - n0 >= 64:
            _tile4(a, a_off, lda, b, np.int64(n0 * 4), b_stride, c, np.int64(n0), np.int64(n16), k4)
            n0 += 64
        rest = (n16 - n0) // 16
        if rest == 3:
            _tile3(a, a_off, lda, b, np.int64(n0 * 4), b_stride, c, np.int64(n0), np.int64(n16), k4)
        elif rest == 2:
            _tile2(a, a_off, lda, b, np.int64(n0 * 4), b_stride, c, np.int64(n0), np.int64(n16), k4)
        elif rest == 1:
            _tile1(a, a_off, lda, b, np.int64(n0 * 4), b_stride, c, np.int64(n0), np.int64(n16), k4)

    @_jit
    def _block_sums8(x, r0, m, zx, b, n16, shift, wsums, g):
        """VNNI: g[:m, :O] (int64) = G for the m rows of x from r0: per 4 rows the tile's P (the last rows with zero
        rows below them), less shift * sum(x) and zx * sum(w')."""
        k = x.shape[1]
        k4 = np.int64(k // 4)
        xf = x.reshape(-1)
        p = np.empty((ROWS, n16), np.int32)
        pad = np.zeros((ROWS, k), np.uint8)
        o = g.shape[1]
        corr = np.empty(o, np.int64)
        for c in range(o):
            corr[c] = zx * wsums[c]
        for q in range(0, m, ROWS):
            rows = min(ROWS, m - q)
            if rows == ROWS:
                _tiles(xf, np.int64((r0 + q) * k), np.int64(k), b, n16, p.reshape(-1), k4)
            else:
                pad[:rows] = x[r0 + q:r0 + q + rows]
                _tiles(pad.reshape(-1), np.int64(0), np.int64(k), b, n16, p.reshape(-1), k4)
            for i in range(rows):
                xr = x[r0 + q + i]
                rs = np.int32(0)
                for j in range(k):  # at most 65,792 * 255 < 2^31
                    rs += np.int32(xr[j])
                gr, pr, r64 = g[q + i], p[i], np.int64(rs)
                for c in range(o):
                    gr[c] = np.int64(pr[c]) - shift[c] * r64 - corr[c]

    def _sums_target(g, m4, n16, chunk4):
        """(int32 flat array, is_g): where the AVX2 tiles store G for m4 rows of n16 channels: an int32 g itself where
        its O is n16 and it has the m4 rows (8-11% faster on MobileNetV2's 1x1 shapes than a copy), else a buffer of
        chunk4 rows that each chunk's G passes through; compiled code only (the overload below picks by g's
        type)."""
        raise NotImplementedError("compiled code only")

    @overload(_sums_target, jit_options=dict(nogil=True, boundscheck=False, error_model="numpy"))
    def _sums_target_typed(g, m4, n16, chunk4):
        if g.dtype != types.int32:
            return lambda g, m4, n16, chunk4: (np.empty(chunk4 * n16, np.int32), False)

        def impl(g, m4, n16, chunk4):
            if g.shape[1] == n16 and g.shape[0] >= m4:
                return g.reshape(-1), True
            return np.empty(chunk4 * n16, np.int32), False
        return impl

    @_jit
    def _block_sums16(x, r0, m, zx, b, n16, g):
        """AVX2: g[:m, :O] (int64, or int32) = G for the m rows of x from r0. Per chunk of CHUNK_ROWS rows: the rows'
        x - zx as int16 (K padded to even with a zero; the rows past m are 0), then per group of 16-channel panels
        whose weights fit in PANEL_GROUP_BYTES, every tile of 4 rows of the chunk on each panel of the group: a
        panel's weights are read once per chunk, where one panel-by-panel pass per 4 rows read every weight once
        per 4 rows (a 7x7 layer's 0.3-0.8 MB of weights 7 to 13 times)."""
        k = x.shape[1]
        kp = k + k % 2
        chunk4 = -(-min(m, CHUNK_ROWS) // ROWS) * ROWS
        a = np.zeros((chunk4, kp), np.int16)
        af = a.reshape(-1)
        dst, is_g = _sums_target(g, -(-m // ROWS) * ROWS, n16, chunk4)
        lda, b_stride, steps, z = np.int64(kp), np.int64(n16 * 2), np.int64(kp // 2), np.int16(zx)
        group = 16 * max(1, PANEL_GROUP_BYTES // (kp * 32))  # a panel: kp x 16 int16
        for c0 in range(0, m, CHUNK_ROWS):
            n_rows = min(CHUNK_ROWS, m - c0)
            for i in range(n_rows):
                xr, ar = x[r0 + c0 + i], a[i]
                for j in range(k):
                    ar[j] = np.int16(xr[j]) - z  # in [-255, 255]
            for i in range(n_rows, -(-n_rows // ROWS) * ROWS):
                a[i, :] = 0
            base = c0 * n16 if is_g else 0
            for g0 in range(0, n16, group):
                for q in range(0, n_rows, ROWS):
                    for n0 in range(g0, min(n16, g0 + group), 16):
                        _tile16(af, np.int64(q * kp), lda, b, np.int64(n0 * 2), b_stride, dst,
                                np.int64(base + q * n16 + n0), np.int64(n16), steps)
            if not is_g:
                for i in range(n_rows):
                    gr, src = g[c0 + i], dst[i * n16:]
                    for c in range(g.shape[1]):
                        gr[c] = src[c]

    def _block_sums(x, r0, m, zx, b, n16, shift, wsums, g):
        """G for the m rows of x from r0 into g (int64) on the tiles of the packed filter ``b``'s instruction set
        (int8: VNNI, int16: AVX2); compiled code only (the overload below picks by b's type, so that only the
        tiles of the filter's instruction set are ever compiled)."""
        raise NotImplementedError("compiled code only")

    @overload(_block_sums, jit_options=dict(nogil=True, boundscheck=False, error_model="numpy"))
    def _block_sums_typed(x, r0, m, zx, b, n16, shift, wsums, g):
        if b.dtype == types.int8:
            return lambda x, r0, m, zx, b, n16, shift, wsums, g: _block_sums8(x, r0, m, zx, b, n16, shift, wsums, g)
        if b.dtype == types.int16:
            return lambda x, r0, m, zx, b, n16, shift, wsums, g: _block_sums16(x, r0, m, zx, b, n16, g)
        return None

    @_pjit
    def _pointwise_sums(x, zx, b, n16, shift, wsums, block, out):
        for t in prange((x.shape[0] + block - 1) // block):
            r0 = t * block
            _block_sums(x, r0, min(block, x.shape[0] - r0), zx, b, n16, shift, wsums, out[r0:])

    @_pjit
    def _pointwise(x, zx, b, n16, shift, wsums, block, gz, scale, offset, y_theta, step, lo, hi, mode, out):
        """Per block of rows (a multiple of 4, its G in cache, of gz's dtype) on numba's threads: G by the tiles,
        then its requantization (jit._requant_rows)."""
        for t in prange((x.shape[0] + block - 1) // block):
            r0 = t * block
            m = min(block, x.shape[0] - r0)
            g = np.empty((-(-m // ROWS) * ROWS, out.shape[1]), gz.dtype)  # whole tiles of rows
            _block_sums(x, r0, m, zx, b, n16, shift, wsums, g)
            jit._requant_rows(g[:m], scale, offset, y_theta, step, lo, hi, mode, out[r0:r0 + m])


    @_pjit
    def _dsp_pointwise(x, zx, b, n16, shift, wsums, block, gz, word, recip_val, shamt, out, lims):
        """nnlib's codes per block of rows: G by the tiles (of gz's dtype), then the d32 requantization of G + word
        (jit._d32_requant, which wraps G to int32 first, as the node's accumulator does); lims[t] the block's
        (min, max) raw values."""
        for t in prange((x.shape[0] + block - 1) // block):
            r0 = t * block
            m = min(block, x.shape[0] - r0)
            g = np.empty((-(-m // ROWS) * ROWS, out.shape[1]), gz.dtype)  # whole tiles of rows
            _block_sums(x, r0, m, zx, b, n16, shift, wsums, g)
            lo, hi = jit._d32_requant(g[:m], word, recip_val, shamt, out[r0:r0 + m])
            lims[t, 0] = lo
            lims[t, 1] = hi


if intrinsic is not None:
    @_pjit
    def _gpu_pointwise(x, zx, b, n16, shift, wsums, block, gz, bias, scale, zp, out):
        """The gpu's codes per block of rows: G by the tiles (of gz's dtype), then
        sat_rte(f32(f32(G + bias) * scale) + zp) with float64 ``bias``: |G|, |bias| < 2^31, so the float64 sum is
        the exact integer and f32 of it rounds to nearest even as float_rte rounds the (unwrapped) int32."""
        zero = np.float32(0)
        for t in prange((x.shape[0] + block - 1) // block):
            r0 = t * block
            m = min(block, x.shape[0] - r0)
            g = np.empty((-(-m // ROWS) * ROWS, out.shape[1]), gz.dtype)  # whole tiles of rows
            _block_sums(x, r0, m, zx, b, n16, shift, wsums, g)
            for i in range(m):
                gr, dst = g[i], out[r0 + i]
                for c in range(out.shape[1]):
                    dst[c] = jit._gpu_code(np.float32(np.float64(gr[c]) + bias[c]), zero, scale[c], zp)


def _rows_per_block(rows: int, o: int) -> int:
    """Rows per block, a multiple of 4: the block's int64 G within 256 KiB, and the blocks a multiple of the
    threads in number, near equal in size (a thread with one block more than the others makes the rest wait)."""
    threads = max(1, jit._num_threads())
    fit = max(ROWS, (1 << 18) // (8 * max(o, 1)))
    blocks = threads * -(-rows // (threads * fit))
    return max(ROWS, -(-(-(-rows // blocks)) // ROWS) * ROWS)


def _g_like(f: PackedFilter) -> np.ndarray:
    """An empty array of the dtype a block's G is kept in: int32 for AVX2 (|G| <= 33,025 * 255 * 255 < 2^31),
    whose conversion to float64 AVX2 does 4 at a time (int64's one at a time: the requantization took 0.55 ns an
    output instead of 0.26-0.42), int64 for VNNI (K up to 65,792; AVX-512 converts int64 too)."""
    return np.empty(0, np.int32 if f.isa is Isa.AVX2 else np.int64)


def pointwise_sums(x: np.ndarray, x_zp: int, f: PackedFilter) -> np.ndarray:
    """int64 [rows, O]: G = sum (x - x_zp) * w' for uint8 x [rows, K] (C-contiguous) and the packed filter."""
    x = np.ascontiguousarray(x)
    out = np.empty((x.shape[0], f.o), np.int64)
    with threads.blas_held():  # numba's threads from here to the run's end: BLAS's must not spin beside them
        _pointwise_sums(x, np.int64(x_zp), f.data, np.int64(f.n16), f.shift, f.sums,
                        _rows_per_block(x.shape[0], f.o), out)
    return out


def pointwise_conv(x: np.ndarray, x_zp: int, f: PackedFilter, rq, out: np.ndarray) -> None:
    """1x1 stride-1 convolution of uint8 x [rows, K] with the packed filter, requantized by ``rq`` (conv.py's
    _ExactRequant, affine from G) into out [rows, O]: per block of rows, G by the tiles and the same float64
    requantization as jit.pointwise_conv's."""
    PointwiseCall(x_zp, f, rq, x.shape[0])(x, out)


class PointwiseCall:
    """:func:`pointwise_conv` for ``rows`` rows with its arguments converted once: a model's convolution calls it
    with the same filter, requantization and row count every run (conv.py keeps one per input shape and thread
    count; the block size depends on both)."""

    def __init__(self, x_zp: int, f: PackedFilter, rq, rows: int):
        self.filter = f
        self.rows = rows
        self.head = (np.int64(x_zp), f.data, np.int64(f.n16), f.shift, f.sums, _rows_per_block(rows, f.o), _g_like(f),
                     rq.scale, rq.offset, rq.y_theta, rq.step, float(rq.lo), float(rq.hi),
                     jit._mode(affine=True, correct=rq.correct, lo=rq.lo))

    def __call__(self, x: np.ndarray, out: np.ndarray) -> None:
        if x.shape[0] != self.rows:
            raise ValueError(f"PointwiseCall: made for {self.rows} rows, got {x.shape[0]}")
        with threads.blas_held():
            _pointwise(np.ascontiguousarray(x), *self.head, out)


def dsp_pointwise(x: np.ndarray, x_zp: int, f: PackedFilter, word: np.ndarray, recip_val: int, shamt: int
                  ) -> tuple[np.ndarray, int, int]:
    """nnlib's d32 requantization (jit.d32_requant) of G + word for uint8 x [rows, K] and the packed filter, per
    block of rows without keeping G: (uint8 codes [rows, O], min raw, max raw), the min / max starting from
    (2^24, -2^24) as jit.d32_requant's."""
    out = np.empty((x.shape[0], f.o), np.uint8)
    block = _rows_per_block(x.shape[0], f.o)
    lims = np.empty((max(1, -(-x.shape[0] // block)), 2), np.int64)
    lims[:, 0], lims[:, 1] = 1 << 24, -(1 << 24)
    with threads.blas_held():
        _dsp_pointwise(np.ascontiguousarray(x), np.int64(x_zp), f.data, np.int64(f.n16), f.shift, f.sums, block,
                       _g_like(f), np.ascontiguousarray(word, dtype=np.int64), np.int64(recip_val), np.int64(shamt),
                       out, lims)
    return out, int(lims[:, 0].min()), int(lims[:, 1].max())


def gpu_pointwise(x: np.ndarray, x_zp: int, f: PackedFilter, bias: np.ndarray, scale: np.ndarray, zp) -> np.ndarray:
    """The gpu convolution's codes [rows, O] of uint8 x [rows, K] (im2col rows past 1x1) with the packed int8
    filter, int bias [O] (every |G + bias| below 2^31: runtime/kernels/gpu.py ``sum_path`` is not "wrap") and float32
    scale [O]."""
    return GpuPointwiseCall(x_zp, f, bias, scale, zp)(x)


class GpuPointwiseCall:
    """:func:`gpu_pointwise` with its arguments converted once (runtime/kernels/gpu.py keeps one per convolution
    and input shape); the block of rows is sized per call, for the rows and threads of that call."""

    def __init__(self, x_zp: int, f: PackedFilter, bias: np.ndarray, scale: np.ndarray, zp):
        self.filter = f
        self.head = (np.int64(x_zp), f.data, np.int64(f.n16), f.shift, f.sums)
        self.tail = (_g_like(f), np.asarray(bias, dtype=np.float64), np.ascontiguousarray(scale, dtype=np.float32),
                     np.float32(zp))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], self.filter.o), np.uint8)
        with threads.blas_held():
            _gpu_pointwise(np.ascontiguousarray(x), *self.head, _rows_per_block(x.shape[0], self.filter.o),
                           *self.tail, out)
        return out
