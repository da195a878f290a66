// The decode GEMV over E0M4 FP4 weights (Transformer-Lite §2.3; format: models/e0m4.py).
//
// linear_gemv_e0m4 is kernels.cl's linear_gemv with one change: a 4-bit code becomes a float by
// two bitwise ops (shift, OR the exponent; reinterpret) instead of an int -> float conversion, and
// the group's affine map is one FMA as for Q4_1. Same work distribution (LIN_T work-items a row,
// LIN_R rows a group), same loads, same four accumulator chains, so the two compare fairly.
// Written for PoCL on a CPU like kernels.cl: aligned vector dereferences, no OpenCL builtins in
// the loop (PoCL's distro build does not inline them); as_float8 and CVT are clang builtins.

// Appended to kernels.cl when built (gpu/e0m4.py): QK, LIN_T, LIN_R, AT, CVT, HALF and hsum8
// are kernels.cl's.

#define E0M4_EXP 0x40000000u   // f32 sign 0, exponent 1: the floats [2, 4)
#define E0M4_SHIFT 19u         // the code is the top 4 of the 23 fraction bits

// 8 codes -> 8 weights: w1 = as_float(EXP | q << 19) in [2, 4), then w1 * scale + (-bias * scale)
inline float8 e0m4_8(uchar8 q, float s, float b)
{
    return as_float8((CVT(q, uint8) << E0M4_SHIFT) | E0M4_EXP) * s + b;
}

// One group: 16 bytes of sequential nibbles (byte i = q[2i] | q[2i+1] << 4) -> 32 weights.
inline void e0m4_block(uchar16 v, float s, float b, float8* w0, float8* w1, float8* w2, float8* w3)
{
    const uchar16 lo = v & (uchar)0x0F, hi = v >> (uchar)4;
    const uchar16 x = (uchar16)(lo.s0, hi.s0, lo.s1, hi.s1, lo.s2, hi.s2, lo.s3, hi.s3,
                                lo.s4, hi.s4, lo.s5, hi.s5, lo.s6, hi.s6, lo.s7, hi.s7);
    const uchar16 y = (uchar16)(lo.s8, hi.s8, lo.s9, hi.s9, lo.sa, hi.sa, lo.sb, hi.sb,
                                lo.sc, hi.sc, lo.sd, hi.sd, lo.se, hi.se, lo.sf, hi.sf);
    *w0 = e0m4_8(x.lo, s, b);
    *w1 = e0m4_8(x.hi, s, b);
    *w2 = e0m4_8(y.lo, s, b);
    *w3 = e0m4_8(y.hi, s, b);
}

// x [1, K] f32, W E0M4 [M, K] (qs u8 [M, K/2], scale and bias f16 [M, K/32]) -> out [1, M].
// global (LIN_T, M rounded up to LIN_R), local (LIN_T, LIN_R).
__kernel void linear_gemv_e0m4(__global uchar* arena, ulong x_o, ulong qs_o, ulong s_o, ulong b_o,
                               ulong out_o, int K, int M)
{
    const int t = get_local_id(0), r = get_global_id(1);
    const int nb = K / QK, rr = r < M ? r : M - 1;   // clamped: all work-items reach the barrier
    const __global uchar16* q = AT(const uchar16, qs_o) + (size_t)rr * nb;
    const __global ushort* sc = AT(const ushort, s_o) + (size_t)rr * nb;
    const __global ushort* bi = AT(const ushort, b_o) + (size_t)rr * nb;
    const __global float8* x = AT(const float8, x_o);
    float8 a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;   // four chains hide the FMA latency
    for (int b = t; b < nb; b += LIN_T) {
        const float s = HALF(sc, b);
        float8 w0, w1, w2, w3;
        e0m4_block(q[b], s, -HALF(bi, b) * s, &w0, &w1, &w2, &w3);   // -bias * s: exact in f32
        a0 += w0 * x[4 * b];
        a1 += w1 * x[4 * b + 1];
        a2 += w2 * x[4 * b + 2];
        a3 += w3 * x[4 * b + 3];
    }
#if LIN_T > 1
    __local float part[LIN_R][LIN_T];
    const float s = row_sum(hsum8((a0 + a1) + (a2 + a3)), part[get_local_id(1)], t);
#else
    const float s = hsum8((a0 + a1) + (a2 + a3));
#endif
    if (t == 0 && r < M) AT(float, out_o)[r] = s;
}
