/*
 * maceq gpu device: ops without an integer kernel, in MACE's fp16_fp32 GPU mode: each op
 * reads half storage, computes in float32, writes half storage (round to nearest even).
 * Upstream shapes: MACE mace/ops/opencl/cl/softmax.cl, common.h (do_sigmoid),
 * resize_bilinear.cl; the arithmetic is the exact float32 sequence documented in
 * docs/dev/semantics-gpu.md (no native_* functions, no mad, no FMA).
 */
#pragma OPENCL FP_CONTRACT OFF

/* exp_f32 on a float32 buffer: exposes the shared routine to the tests, bit for bit. */
__kernel void exp_f32_buf(__global const float *x, __global float *out, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  out[gid] = exp_f32(x[gid]);
}

/* One work item per row of `depth` halves (last axis). */
__kernel void softmax_half(__global const ushort *x, __global ushort *out, int depth, int total) {
  const int row = get_global_id(0);
  if (row >= total) return;
  const size_t base = (size_t)row * depth;
  float m = load_half(x, base);
  for (int i = 1; i < depth; ++i) m = fmax(m, load_half(x, base + i));
  float sum = 0.0f;
  for (int i = 0; i < depth; ++i) sum = sum + exp_f32(load_half(x, base + i) - m);
  for (int i = 0; i < depth; ++i) store_half(exp_f32(load_half(x, base + i) - m) / sum, out, base + i);
}

/* kind: 0 sigmoid, 1 hard sigmoid (alpha, beta), 2 hard swish. */
__kernel void activation_half(__global const ushort *x, __global ushort *out,
                              int kind, float alpha, float beta, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  const float v = load_half(x, gid);
  float y;
  if (kind == 0) {
    y = 1.0f / (1.0f + exp_f32(-v));
  } else if (kind == 1) {
    float s = alpha * v;
    s = s + beta;
    y = fmin(fmax(s, 0.0f), 1.0f);
  } else {
    const float t = fmin(fmax(v + 3.0f, 0.0f), 6.0f);
    y = (v * t) / 6.0f;
  }
  store_half(y, out, gid);
}

/* a and b are already broadcast to the output shape. */
__kernel void mul_half(__global const ushort *a, __global const ushort *b, __global ushort *out, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  store_half(load_half(a, gid) * load_half(b, gid), out, gid);
}

inline float resize_coord(int i, float scale, int half_pixel) {
  if (half_pixel) {
    float v = convert_float(i) + 0.5f;
    v = v * scale;
    v = v - 0.5f;
    return fmax(v, 0.0f);
  }
  return convert_float(i) * scale;
}

/* mix(a, b, t) = f32(f32(f32(b - a) * t) + a): MACE's mad((b - a), t, a), unfused. */
inline float mix_f32(float a, float b, float t) {
  float d = (b - a) * t;
  return d + a;
}

__kernel void resize_bilinear_half(__global const ushort *x, __global ushort *out,
                                   int H, int W, int C, int OH, int OW,
                                   float height_scale, float width_scale, int half_pixel, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  const int4 p = nhwc_of(gid, OH, OW, C);
  const int n = p.s0, oh = p.s1, ow = p.s2, c = p.s3;

  const float hv = resize_coord(oh, height_scale, half_pixel);
  const float wv = resize_coord(ow, width_scale, half_pixel);
  const int h0 = min(convert_int(floor(hv)), H - 1), h1 = min(h0 + 1, H - 1);
  const int w0 = min(convert_int(floor(wv)), W - 1), w1 = min(w0 + 1, W - 1);
  const float ly = hv - convert_float(h0);
  const float lx = wv - convert_float(w0);

  const size_t r0 = ((size_t)n * H + h0) * W, r1 = ((size_t)n * H + h1) * W;
  const float tl = load_half(x, (r0 + w0) * C + c), tr = load_half(x, (r0 + w1) * C + c);
  const float bl = load_half(x, (r1 + w0) * C + c), br = load_half(x, (r1 + w1) * C + c);
  const float top = mix_f32(tl, tr, lx);
  const float bottom = mix_f32(bl, br, lx);
  store_half(mix_f32(top, bottom, ly), out, gid);
}
