/*
 * maceq gpu device: Quantize (float32 -> uint8), Dequantize (uint8 -> float32), and the
 * two boundaries of the float path: uint8 -> half storage and half storage -> uint8.
 */
#pragma OPENCL FP_CONTRACT OFF

__kernel void quantize_f32(__global const float *x, __global uchar *out,
                           float inv_scale, int zp, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  out[gid] = quant(x[gid], inv_scale, (float)zp);
}

__kernel void dequantize_u8(__global const uchar *q, __global float *out,
                            float scale, int zp, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  out[gid] = dequant(q[gid], scale, zp);
}

/* half(f32(scale * float(q - zp))): the half image a Dequantize op writes in fp16 mode. */
__kernel void dequantize_half(__global const uchar *q, __global ushort *out,
                              float scale, int zp, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  store_half(dequant(q[gid], scale, zp), out, gid);
}

/* quant(float(h)): a Quantize op reading a half image. */
__kernel void quantize_half(__global const ushort *h, __global uchar *out,
                            float inv_scale, int zp, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  out[gid] = quant(load_half(h, gid), inv_scale, (float)zp);
}
