/*
 * maceq gpu device: helpers shared by every kernel file. The backend compiles each
 * kernel file with this file prepended (runtime/opencl/backend.py), with the build
 * option -cl-fp32-correctly-rounded-divide-sqrt (IEEE float32 division).
 *
 * Numerics (docs/dev/semantics-gpu.md; numpy simulation: runtime/kernels/gpu.py):
 * every float operation below is one IEEE float32 operation rounded to nearest even.
 * FP_CONTRACT OFF forbids fusing a multiply and an add into an FMA; PoCL (LLVM) fuses
 * them otherwise, whatever the other build options say (docs/oracle-notes.md).
 */
#pragma OPENCL FP_CONTRACT OFF

/* (n, h, w, c) of flat index `gid` in an NHWC tensor [N, H, W, C]. */
inline int4 nhwc_of(int gid, int H, int W, int C) {
  const int c = gid % C;
  int t = gid / C;
  const int w = t % W;
  t /= W;
  return (int4)(t / H, t % H, w, c);
}

/* int32 accumulator -> uint8: sat_rte(f32(f32(float_rte(acc) * scale) + zp)).
 * convert_float_rte rounds once |acc| > 2^24; convert_uchar_sat_rte rounds half to
 * even and clamps to [0, 255] (NaN -> 0, OpenCL C 6.2.3.3). */
inline uchar requant_acc(int acc, float scale, float zp) {
  float y = convert_float_rte(acc) * scale;
  y = y + zp;
  return convert_uchar_sat_rte(y);
}

/* uint8 code -> float32: f32(scale * float(q - zp)); q - zp in [-255, 255] converts exactly. */
inline float dequant(uchar q, float scale, int zp) {
  return scale * convert_float((int)q - zp);
}

/* float32 -> uint8: sat_rte(f32(f32(v * inv_scale) + zp)), inv_scale = f32(1 / scale) on the host. */
inline uchar quant(float v, float inv_scale, float zp) {
  float y = v * inv_scale;
  y = y + zp;
  return convert_uchar_sat_rte(y);
}

/* Half storage: buffers of IEEE binary16 bits (ushort), read exactly, written with
 * round to nearest even (overflow -> inf). vload_half/vstore_half_rte are core OpenCL C;
 * no cl_khr_fp16 needed. */
inline float load_half(__global const ushort *p, size_t i) {
  return vload_half(i, (__global const half *)p);
}

inline void store_half(float v, __global ushort *p, size_t i) {
  vstore_half_rte(v, i, (__global half *)p);
}

/* exp_f32: a fixed sequence of float32 operations (Cephes expf), so that the result does
 * not depend on the device's exp()/native_exp(). NaN -> NaN, x > 88 -> inf, x < -86 -> 0;
 * otherwise within 2 ulp of exp and never a denormal. */
inline float exp_f32(float x) {
  if (isnan(x)) return x;
  if (x > 88.0f) return INFINITY;
  if (x < -86.0f) return 0.0f;
  float n = rint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float z = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r;
  p = p + 1.0f;
  /* 2^n for n in [-124, 127]: a normal float32 built from its exponent bits, so the
   * multiply is exact. */
  float pow2 = as_float((convert_int(n) + 127) << 23);
  return p * pow2;
}
