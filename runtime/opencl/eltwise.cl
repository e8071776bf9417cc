/*
 * maceq gpu device: uint8 Eltwise SUM/SUB and the requantization of a uint8 tensor to
 * another scale/zero point (Concat inputs). Dequantize to float32, compute, quantize
 * with round to nearest even. No half storage: these are integer-kernel ops.
 */
#pragma OPENCL FP_CONTRACT OFF

/* out = quant(f32(dequant(a) +- dequant(b))); a and b are already broadcast. */
__kernel void eltwise_u8(__global const uchar *a, __global const uchar *b, __global uchar *out,
                         float a_scale, int a_zp, float b_scale, int b_zp,
                         float out_inv_scale, int out_zp, int subtract, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  const float fa = dequant(a[gid], a_scale, a_zp);
  const float fb = dequant(b[gid], b_scale, b_zp);
  const float r = subtract ? fa - fb : fa + fb;
  out[gid] = quant(r, out_inv_scale, (float)out_zp);
}

/* out = quant(dequant(x)) with the output's reciprocal scale. */
__kernel void requant_u8(__global const uchar *x, __global uchar *out,
                         float in_scale, int in_zp, float out_inv_scale, int out_zp, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  out[gid] = quant(dequant(x[gid], in_scale, in_zp), out_inv_scale, (float)out_zp);
}
