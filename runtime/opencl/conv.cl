/*
 * maceq gpu device: int8 Conv2D, one kernel for every group count. DepthwiseConv2d runs
 * it with groups = C (the host rearranges [KH, KW, C, M] to [C*M, KH, KW, 1]) and
 * FullyConnected as a 1x1 Conv2D on a 1x1 image. One work item per output element; the
 * global size is padded to a multiple of the fixed local size, so the kernel checks
 * gid < total.
 *
 * Activations uint8 NHWC with zero point x_zp; weights int8 symmetric per output channel
 * (zero point 0), layout [O, KH, KW, C/groups]; bias int32 per output channel;
 * scale[o] = f32(f32(s_in*s_w[o])/s_out). Output channel o reads input channels
 * [g*Cg, (g+1)*Cg) with g = o / (O/groups), Cg = C/groups.
 *
 * Accumulation: acc = bias + sum (x - x_zp) * w over the in-image taps. Each product
 * fits in 16 bits (|x - x_zp| <= 255, |w| <= 128); the sum is kept in a uint so that
 * overflow wraps modulo 2^32 with defined behaviour (signed overflow is undefined in
 * OpenCL C), then reinterpreted as int32: equal to the exact sum while it fits in int32.
 */
#pragma OPENCL FP_CONTRACT OFF

__kernel void conv2d_u8(__global const uchar *x,    /* [N, H, W, C] */
                        __global const char *w,     /* [O, KH, KW, C/groups] */
                        __global const int *bias,   /* [O] */
                        __global const float *scale,/* [O] */
                        __global uchar *out,        /* [N, OH, OW, O] */
                        int H, int W, int C, int O, int groups, int KH, int KW, int OH, int OW,
                        int stride_h, int stride_w, int pad_top, int pad_left,
                        int dil_h, int dil_w, int x_zp, int out_zp, int total) {
  const int gid = get_global_id(0);
  if (gid >= total) return;
  const int4 p = nhwc_of(gid, OH, OW, O);
  const int n = p.s0, oh = p.s1, ow = p.s2, o = p.s3;
  const int Cg = C / groups;
  const int c0 = (o / (O / groups)) * Cg;

  uint acc = as_uint(bias[o]);
  for (int kh = 0; kh < KH; ++kh) {
    const int ih = oh * stride_h - pad_top + kh * dil_h;
    if (ih < 0 || ih >= H) continue;
    for (int kw = 0; kw < KW; ++kw) {
      const int iw = ow * stride_w - pad_left + kw * dil_w;
      if (iw < 0 || iw >= W) continue;
      __global const uchar *xr = x + (((size_t)n * H + ih) * W + iw) * C + c0;
      __global const char *wr = w + (((size_t)o * KH + kh) * KW + kw) * Cg;
      for (int c = 0; c < Cg; ++c) {
        acc += as_uint(((int)xr[c] - x_zp) * (int)wr[c]);
      }
    }
  }
  out[gid] = requant_acc(as_int(acc), scale[o], (float)out_zp);
}
