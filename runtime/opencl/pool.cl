/*
 * maceq gpu device: uint8 max and average pooling (NHWC), one kernel with a mode flag.
 * The window of output (oh, ow) covers rows [oh*stride_h - pad_top, + KH) and the
 * matching columns, clipped to the image: padding never contributes and is not counted.
 * The output keeps the input's scale and zero point. The host guarantees that no window
 * is empty (pads < kernel).
 *   max:     out = max(0, max of the in-bounds codes)
 *   average: out = sat_rte(f32(float_rte(sum) / float(count))), IEEE division, half to even
 */
#pragma OPENCL FP_CONTRACT OFF

__kernel void pool_u8(__global const uchar *x, __global uchar *out,
                      int H, int W, int C, int KH, int KW, int OH, int OW,
                      int stride_h, int stride_w, int pad_top, int pad_left, int average, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  const int4 p = nhwc_of(gid, OH, OW, C);
  const int h0 = max(p.s1 * stride_h - pad_top, 0), h1 = min(p.s1 * stride_h - pad_top + KH, H);
  const int w0 = max(p.s2 * stride_w - pad_left, 0), w1 = min(p.s2 * stride_w - pad_left + KW, W);
  int sum = 0; /* <= 255 * taps: no overflow below 2^23 taps */
  uchar m = 0;
  for (int ih = h0; ih < h1; ++ih) {
    for (int iw = w0; iw < w1; ++iw) {
      const uchar v = x[(((size_t)p.s0 * H + ih) * W + iw) * C + p.s3];
      sum += (int)v;
      m = max(m, v);
    }
  }
  if (average) {
    const float count = convert_float((h1 - h0) * (w1 - w0));
    out[gid] = convert_uchar_sat_rte(convert_float_rte(sum) / count);
  } else {
    out[gid] = m;
  }
}
