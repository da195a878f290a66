// socllm's fused decode kernels (N == 1), appended to kernels.cl when it is built; epilogue.cl
// follows with split-K attention and the last-work-group epilogues.
//
// Op by op, a decode step of SmolLM2-135M is 453 launches, and PoCL spends ~3-4.5 us on each
// (scripts/profile_decode.py). Fused (Transformer-Lite §2.2; graph/fuse.py), a layer is 5:
//   qkv_rope           the Q, K and V GEMVs as one launch; RoPE applied to Q and K in registers
//                      from a per-step table (rope_table); K and V written into KV row pos0
//   attention_merge    split-K attention; its last work-group merges and prepares the row
//   linear_act_norm    o GEMV + residual; its last work-group runs the FFN's rmsnorm (norm_prep)
//   gate_up_silu_prep  gate and up rows of a work-item, silu(g) * u; the last group prepares it
//   linear_act_norm    down GEMV + residual; the last group runs the next layer's rmsnorm
// Kernels here without an epilogue (prep, norm_prep, linear_act, gate_up_silu, attention_split,
// merge_prep) serve the tasks the pass cannot chain (and the tests).
//
// The prepared activation ("act", a scratch area of the arena at s_o; ACT_BITS picks the format):
//   values [K]     per 32-block its 16 even elements, then its 16 odd ones: they line up with the
//                  low and high nibbles of a Q4_1 block's 16 bytes, so the GEMV shuffles nothing.
//                  ACT_BITS 32: f32, the oracle's numerics (only reassociated);
//                  ACT_BITS 16: int16 per block (precision q16): relative error <= 2^-16 of the
//                    block's max, products in integers (pmaddwd), ~1.6x fewer instructions;
//                  ACT_BITS 8: int8 per block (precision q8, llama.cpp's Q8_1 idea; pmaddubsw)
//   dx f32 [K/32]  block scale (1 for f32, max|x| / 32767 for int16, max|x| / 127 for int8)
//                  (lm_head_act reads its values in natural order instead: norm_prep natural=1)
//   sx f32 [K/32]  block sum of the values as stored (f32: of x; int16 / int8: dx * sum of the
//                  integers, as llama.cpp's Q8_1 keeps it): sum_j (d q_j + m) x_j =
//                  d sum_j q_j x_j + m sx, so the GEMV multiplies by d once per block and never
//                  forms d q + m, and at q16 / q8 it is exactly the weights times the rounded x

// x86 builds use AVX2 / F16C target builtins directly: clang inlines them, unlike PoCL's library
// builtins (see kernels.cl); SOCLLM_PORTABLE or another target takes plain OpenCL C.
#if defined(__AVX2__) && defined(__F16C__) && defined(__clang__) && !defined(SOCLLM_PORTABLE)
#define Q8_X86 1
typedef char v32qi __attribute__((__vector_size__(32)));
typedef short v16hi __attribute__((__vector_size__(32)));
typedef int v8si __attribute__((__vector_size__(32)));
typedef uchar uchar32 __attribute__((ext_vector_type(32)));
typedef char char32 __attribute__((ext_vector_type(32)));
typedef ushort ushort8u __attribute__((ext_vector_type(8), aligned(2)));   // unaligned loads
typedef float float8u __attribute__((ext_vector_type(8), aligned(4)));
#define HALF8(p) __builtin_ia32_vcvtph2ps256(__builtin_astype(*(const __global ushort8u*)(p), short8))
#define LOAD8(p) (*(const __global float8u*)(p))
// sum of 4 u8 x s8 products per int lane (a u8, b s8, both v32qi), no product pair beyond int16:
// one vpdpbusd with AVX512-VNNI, else pmaddubsw (pairs, int16) and pmaddwd (pairs, int32)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
#define DOT_U8S8(a, b) __builtin_astype(__builtin_ia32_vpdpbusd256(__builtin_astype((int8)0, v8si), \
        __builtin_astype(a, v8si), __builtin_astype(b, v8si)), int8)
#else
#define DOT_U8S8(a, b) __builtin_astype(__builtin_ia32_pmaddwd256(__builtin_ia32_pmaddubsw256(a, b), \
        (v16hi){1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}), int8)
#endif
#else
#define HALF8(p) vload_half8(0, (const __global half*)(p))
#define LOAD8(p) vload8(0, (p))
#endif

#ifndef ACT_BITS
#define ACT_BITS 32
#endif
#define ACT_BYTES (ACT_BITS / 8)
#define ACT_QMAX (ACT_BITS == 8 ? 127.0f : 32767.0f)

// sum_j q_w * q_x of one block as int lanes (q8): 16 weight bytes, 32 activation bytes (evens, odds)
inline int8 dot_q4q8(uchar16 v, const __global char* xb)
{
#ifdef Q8_X86
    const uchar32 w = __builtin_shufflevector(v, v >> (uchar)4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
            11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31);
    return DOT_U8S8(__builtin_astype(w & (uchar)0x0F, v32qi), *(const __global v32qi*)xb);
#else
    const __global char16* x = (const __global char16*)xb;   // |p| <= 2 * 15 * 127: fits a short
    const short16 p = convert_short16(v & (uchar)0x0F) * convert_short16(x[0])
                    + convert_short16(v >> (uchar)4) * convert_short16(x[1]);
    return convert_int8(p.lo) + convert_int8(p.hi);
#endif
}


#if ACT_BITS == 16
// sum_j q_w * q_x of one block as int lanes: 16 weight bytes, 32 int16 activations (evens, odds)
inline int8 dot_q4q16(uchar16 w, const __global short16* x)
{
#ifdef Q8_X86
    const v8si lo = __builtin_ia32_pmaddwd256(__builtin_astype(CVT(w & (uchar)0x0F, short16), v16hi),
                                              __builtin_astype(x[0], v16hi));
    const v8si hi = __builtin_ia32_pmaddwd256(__builtin_astype(CVT(w >> (uchar)4, short16), v16hi),
                                              __builtin_astype(x[1], v16hi));
    return __builtin_astype(lo + hi, int8);
#else
    const int16 p = CVT(w & (uchar)0x0F, int16) * CVT(x[0], int16)
                  + CVT(w >> (uchar)4, int16) * CVT(x[1], int16);
    return p.lo + p.hi;
#endif
}
#endif

// one 32-block (four float8 in order) of the row into the prepared activation
inline void prep_block(float8 x0, float8 x1, float8 x2, float8 x3, __global uchar* arena,
                       ulong s_o, int K, int b, int natural)
{
    __global float* dx = AT(float, s_o + (ulong)ACT_BYTES * K);
#if ACT_BITS < 32
    const int8 abs_mask = (int8)0x7FFFFFFF, sign = (int8)0x80000000, one_half = as_int8((float8)0.5f);
    const float8 a0 = as_float8(as_int8(x0) & abs_mask), a1 = as_float8(as_int8(x1) & abs_mask);
    const float8 a2 = as_float8(as_int8(x2) & abs_mask), a3 = as_float8(as_int8(x3) & abs_mask);
    const float8 m01 = a0 > a1 ? a0 : a1, m23 = a2 > a3 ? a2 : a3, m8 = m01 > m23 ? m01 : m23;
    const float4 m4 = m8.lo > m8.hi ? m8.lo : m8.hi;
    const float2 m2 = m4.lo > m4.hi ? m4.lo : m4.hi;
    const float d = (m2.x > m2.y ? m2.x : m2.y) / ACT_QMAX, id = d != 0.0f ? 1.0f / d : 0.0f;
    const float8 t0 = x0 * id, t1 = x1 * id, t2 = x2 * id, t3 = x3 * id;
    const int8 q0 = CVT(t0 + as_float8((as_int8(t0) & sign) | one_half), int8);   // round half away
    const int8 q1 = CVT(t1 + as_float8((as_int8(t1) & sign) | one_half), int8);
    const int8 q2 = CVT(t2 + as_float8((as_int8(t2) & sign) | one_half), int8);
    const int8 q3 = CVT(t3 + as_float8((as_int8(t3) & sign) | one_half), int8);
    const int16 e = natural ? (int16)(q0, q1) : (int16)(q0.even, q1.even, q2.even, q3.even);
    const int16 o = natural ? (int16)(q2, q3) : (int16)(q0.odd, q1.odd, q2.odd, q3.odd);
#if ACT_BITS == 8
    __global char16* v = AT(char16, s_o) + 2 * b;
    v[0] = CVT(e, char16);
    v[1] = CVT(o, char16);
#else
    __global short16* v = AT(short16, s_o) + 2 * b;
    v[0] = CVT(e, short16);
    v[1] = CVT(o, short16);
#endif
    dx[b] = d;
    // the block sum of the ROUNDED values (llama.cpp's Q8_1 s = d sum q): the minimum's term
    // m sx then pairs with the same x as d sum q_w q_x does. With the exact sum instead, the
    // rounding errors e_j meet (d q_j + m) - m = d q_j, codes 0..15 all of one sign, not the
    // weights themselves: a common-mode error ~|m| / |w| times larger (on SmolLM2: logit error
    // 2-3x llama.cpp's int8, top-1 = llama.cpp's 0.92 vs 0.97 now and f32's 0.965;
    // scripts/results/quality-2core-zen5-q8-before-fix.txt, quality-2core-zen5.txt).
    // The int sum is exact in f32 (|sum| <= 32 * 32767 < 2^24).
    dx[K / QK + b] = d * hsum8(CVT((q0 + q1) + (q2 + q3), float8));
#else
    __global float8* v = AT(float8, s_o) + 4 * b;
    v[0] = natural ? x0 : (float8)(x0.even, x1.even);
    v[1] = natural ? x1 : (float8)(x2.even, x3.even);
    v[2] = natural ? x2 : (float8)(x0.odd, x1.odd);
    v[3] = natural ? x3 : (float8)(x2.odd, x3.odd);
    dx[b] = 1.0f;
    dx[K / QK + b] = hsum8((x0 + x1) + (x2 + x3));
#endif
}

// sum_j q_j x_j of weight block w against prepared block b, as float8 partial sums
inline float8 block_dot(uchar16 w, const __global uchar* act, int b)
{
#if ACT_BITS == 8
    return CVT(dot_q4q8(w, (const __global char*)act + b * QK), float8);
#elif ACT_BITS == 16
    return CVT(dot_q4q16(w, (const __global short16*)act + 2 * b), float8);
#else
    const __global float8* x = (const __global float8*)act + 4 * b;
    const uchar16 lo = w & (uchar)0x0F, hi = w >> (uchar)4;
    return (CVT(lo.lo, float8) * x[0] + CVT(lo.hi, float8) * x[1])
         + (CVT(hi.lo, float8) * x[2] + CVT(hi.hi, float8) * x[3]);
#endif
}

// sum_j w_j x_j of 32 integer weights against prepared block b, its values in two halves of 16
// (a pairs with the block's first 16 activation values, c with its last 16), as float8 partial
// sums: the paths without x86's byte products (int8 portable, int16, f32 activations)
inline float8 dot_halves(short16 a, short16 c, const __global uchar* act, int b)
{
#if ACT_BITS == 8
    const __global char16* x = (const __global char16*)act + 2 * b;
    const int16 p = CVT(a, int16) * CVT(x[0], int16) + CVT(c, int16) * CVT(x[1], int16);
    return CVT(p.lo + p.hi, float8);
#elif ACT_BITS == 16
    const __global short16* x = (const __global short16*)act + 2 * b;
#ifdef Q8_X86
    const v8si e = __builtin_ia32_pmaddwd256(__builtin_astype(a, v16hi), __builtin_astype(x[0], v16hi));
    const v8si o = __builtin_ia32_pmaddwd256(__builtin_astype(c, v16hi), __builtin_astype(x[1], v16hi));
    return CVT(__builtin_astype(e + o, int8), float8);
#else
    const int16 p = CVT(a, int16) * CVT(x[0], int16) + CVT(c, int16) * CVT(x[1], int16);
    return CVT(p.lo + p.hi, float8);
#endif
#else
    const __global float8* x = (const __global float8*)act + 4 * b;
    const float16 fa = CVT(a, float16), fc = CVT(c, float16);
    return (fa.lo * x[0] + fa.hi * x[1]) + (fc.lo * x[2] + fc.hi * x[3]);
#endif
}

#if !W_Q4_1 && WHB
// sum_j c_j x_j of a block's codes (lo: 16 bytes of low nibbles, he / ho: the high bits of the
// even and the odd weights, kernels.cl high_codes) against prepared block b, as float8 partial
// sums, where c = q - W_ZERO: formats whose minimum is a fixed multiple of the scale (Q5_0 16,
// Q8_0 128, Q6_K 32; m = -W_ZERO d) take signed codes and no minimum term, as llama.cpp does;
// the others (W_ZERO 0) unsigned codes. One product per weight. mask keeps the weights of lo's
// bytes it keeps (a 16-weight half: bytes 0-7 hold weights 0-15, the lanes 0-7 of he and ho).
inline float8 codes_dot(uchar16 lo, uchar16 he, uchar16 ho, uchar16 mask, const __global uchar* act, int b)
{
    const uchar16 ev = (lo & (uchar)0x0F) | (he << (uchar)4);       // even weights' codes
    const uchar16 od = (lo >> (uchar)4) | (ho << (uchar)4);         // odd weights' codes
#if W_ZERO
    const char16 ce = as_char16(ev - (uchar)W_ZERO) & as_char16(mask);
    const char16 co = as_char16(od - (uchar)W_ZERO) & as_char16(mask);
#else
    const uchar16 ce = ev & mask, co = od & mask;
#endif
#if ACT_BITS == 8 && defined(Q8_X86)
    const v32qi x = *((const __global v32qi*)act + b);                 // 16 evens, then 16 odds
#if W_ZERO    // s8 * s8: |c| times x with c's sign moved onto x (|c| <= 128, |x| <= 127)
    const v32qi c = __builtin_astype((char32)(ce, co), v32qi);
    return CVT(DOT_U8S8(__builtin_ia32_psignb256(c, c), __builtin_ia32_psignb256(x, c)), float8);
#else         // u8 * s8: codes of at most 6 bits, so a pair's sum fits 16 bits
    return CVT(DOT_U8S8(__builtin_astype((uchar32)(ce, co), v32qi), x), float8);
#endif
#else
    return dot_halves(CVT(ce, short16), CVT(co, short16), act, b);
#endif
}
#endif

#if !W_Q4_1 && WHB && ACT_BITS < 32 && defined(Q8_X86)
#define W_X86_CODES 1
// block b's 32 codes minus W_ZERO, as bytes in the prepared activation's order (evens, then
// odds): lo's nibbles, and the high bits from h (kernels.cl W_ROW's m) spread by byte shuffles
inline uchar32 codes32(uchar16 lo, const __global uchar* h, int b)
{
    uchar32 c = __builtin_shufflevector(lo, lo >> (uchar)4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) & (uchar)0x0F;
#if WHB == 16
    const uchar16 v = ((const __global uchar16*)h)[b];
    c |= __builtin_shufflevector(v << (uchar)4, v, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31) & (uchar)0xF0;
#else
    const uchar32 bit = (uchar32)(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128,
                                  1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    const __global uint* w = (const __global uint*)h + (WHB / 4) * b;
    const uchar4 w0 = as_uchar4(w[0]);
    const uchar32 b0 = __builtin_shufflevector(w0, w0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    c |= __builtin_astype((b0 & bit) == bit, uchar32) & (uchar)0x10;   // lane j: bit j of w[0]
#if WHB == 8
    const uchar4 w1 = as_uchar4(w[1]);
    const uchar32 b1 = __builtin_shufflevector(w1, w1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                               2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    c |= __builtin_astype((b1 & bit) == bit, uchar32) & (uchar)0x20;
#endif
#endif
    return c - (uchar)W_ZERO;
}

// sum_j c_j x_j of codes32's bytes against prepared block b, as int lanes: HALVES(a, c) gives
// a lane vector of a where the lane holds weights 0-15, of c where it holds weights 16-31
#if ACT_BITS == 16
#define HALVES(a, c) ((float8)(a, a, a, a, c, c, c, c))
inline float8 dot32(uchar32 c, const __global uchar* act, int b)
{
    const __global short16* x = (const __global short16*)act + 2 * b;
#if W_ZERO
    const char32 cs = __builtin_astype(c, char32);
    const short16 ce = CVT(cs.lo, short16), co = CVT(cs.hi, short16);
#else
    const short16 ce = CVT(c.lo, short16), co = CVT(c.hi, short16);
#endif
    const v8si e = __builtin_ia32_pmaddwd256(__builtin_astype(ce, v16hi), __builtin_astype(x[0], v16hi));
    const v8si o = __builtin_ia32_pmaddwd256(__builtin_astype(co, v16hi), __builtin_astype(x[1], v16hi));
    return CVT(__builtin_astype(e + o, int8), float8);
}
#else
#define HALVES(a, c) ((float8)(a, a, c, c, a, a, c, c))
inline float8 dot32(uchar32 c, const __global uchar* act, int b)
{
    const v32qi x = *((const __global v32qi*)act + b);
#if W_ZERO          // s8 * s8: |c| times x with c's sign moved onto x
    const v32qi cs = __builtin_astype(c, v32qi);
    return CVT(DOT_U8S8(__builtin_ia32_psignb256(cs, cs), __builtin_ia32_psignb256(x, cs)), float8);
#else               // u8 * s8: 5-bit codes, a pair's sum fits 16 bits
    return CVT(DOT_U8S8(__builtin_astype(c, v32qi), x), float8);
#endif
}
#endif
#endif

#if defined(W_FLT)         // float weights run op by op (graph/fuse.py): no fused dot
#elif !W_Q4_1
// sum_j w_j x_j of block b of a weight row in the build's format (q, d, m: kernels.cl W_ROW's
// pointers) against the prepared activation, as float8 partial sums; a free minimum's term as
// well (its scalar in *mt). 16-weight groups take each half's codes masked apart.
inline float8 w_block_dot(const __global uchar16* q, const __global wsc_t* d, const __global uchar* m,
                          int b, const __global uchar* xv, const __global float* dx,
                          const __global float* sx, float* mt)
{
#if defined(W_X86_CODES)
    const float8 s = dot32(codes32(q[b], m, b), xv, b);
#if WGB == 1
#if !W_ZERO
    *mt += WM(d, b) * sx[b];
#endif
    return s * (WD(d, b) * dx[b]);
#else               // Q6_K: each half its scale, lane by lane
    const float d0 = WD(d, 2 * b), d1 = WD(d, 2 * b + 1);
    return s * (HALVES(d0, d1) * dx[b]);
#endif
#elif WHB
    uchar16 he, ho;
    high_codes(m, b, &he, &ho);
#if WGB == 1
    const float8 s = codes_dot(q[b], he, ho, (uchar16)255, xv, b);
#if !W_ZERO
    *mt += WM(d, b) * sx[b];
#endif
    return s * (WD(d, b) * dx[b]);
#else         // Q6_K: signed codes (W_ZERO), so no minimum term
    const uchar16 first = (uchar16)(255, 255, 255, 255, 255, 255, 255, 255, 0, 0, 0, 0, 0, 0, 0, 0);
    return (codes_dot(q[b], he, ho, first, xv, b) * WD(d, 2 * b)
            + codes_dot(q[b], he, ho, ~first, xv, b) * WD(d, 2 * b + 1)) * dx[b];
#endif
#else               // 4-bit codes, 32-weight groups (Q4_K)
    *mt += WM(d, b) * sx[b];
    return block_dot(q[b], xv, b) * (WD(d, b) * dx[b]);
#endif
}

// rows ra and rb of a weight [., K] in the build's format times the prepared activation
inline float2 dot2(__global uchar* arena, ulong qs_o, ulong d_o, ulong m_o, int ra, int rb,
                   int K, ulong s_o)
{
    const int nb = K / QK;
    const __global uchar16* qa = AT(const uchar16, qs_o) + (size_t)ra * nb;
    const __global uchar16* qb = AT(const uchar16, qs_o) + (size_t)rb * nb;
    const __global wsc_t* da = AT(const wsc_t, d_o) + (size_t)ra * nb * 2 * WGB;
    const __global wsc_t* db = AT(const wsc_t, d_o) + (size_t)rb * nb * 2 * WGB;
    const __global uchar* ma = AT(const uchar, m_o) + (size_t)ra * nb * WHB;
    const __global uchar* mb = AT(const uchar, m_o) + (size_t)rb * nb * WHB;
    const __global uchar* xv = AT(const uchar, s_o);
    const __global float* dx = AT(const float, s_o + (ulong)ACT_BYTES * K);
    const __global float* sx = dx + nb;
    float8 aa = 0.0f, ab = 0.0f;
    float sa = 0.0f, sb = 0.0f;
    int b = 0;
#if defined(W_X86_CODES) && WGB == 1
    float8 ma8 = 0.0f, mb8 = 0.0f;
    for (; b + 8 <= nb; b += 8) {       // 8 blocks: their (d, m) pairs converted as vectors
        const float8 dx8 = LOAD8(dx + b), sx8 = LOAD8(sx + b);
#ifdef W_F32
        const float8 a0 = LOAD8(da + 2 * b), a1 = LOAD8(da + 2 * b + 8);
        const float8 b0 = LOAD8(db + 2 * b), b1 = LOAD8(db + 2 * b + 8);
#else
        const float8 a0 = HALF8(da + 2 * b), a1 = HALF8(da + 2 * b + 8);
        const float8 b0 = HALF8(db + 2 * b), b1 = HALF8(db + 2 * b + 8);
#endif
        float sca[8] __attribute__((aligned(32))), scb[8] __attribute__((aligned(32)));
        *(float8*)sca = (float8)(a0.even, a1.even) * dx8;
        *(float8*)scb = (float8)(b0.even, b1.even) * dx8;
#if !W_ZERO
        ma8 += (float8)(a0.odd, a1.odd) * sx8;
        mb8 += (float8)(b0.odd, b1.odd) * sx8;
#endif
#pragma unroll
        for (int j = 0; j < 8; j++) {
            aa += dot32(codes32(qa[b + j], ma, b + j), xv, b + j) * sca[j];
            ab += dot32(codes32(qb[b + j], mb, b + j), xv, b + j) * scb[j];
        }
    }
    sa = hsum8(ma8), sb = hsum8(mb8);
#endif
    for (; b < nb; b++) {
        aa += w_block_dot(qa, da, ma, b, xv, dx, sx, &sa);
        ab += w_block_dot(qb, db, mb, b, xv, dx, sx, &sb);
    }
    return (float2)(hsum8(aa) + sa, hsum8(ab) + sb);
}
#else
// rows ra and rb of a Q4_1 weight [., K] times the prepared activation: two rows share its loads
inline float2 dot2(__global uchar* arena, ulong qs_o, ulong d_o, ulong m_o, int ra, int rb,
                   int K, ulong s_o)
{
    const int nb = K / QK;
    const __global uchar16* qa = AT(const uchar16, qs_o) + (size_t)ra * nb;
    const __global uchar16* qb = AT(const uchar16, qs_o) + (size_t)rb * nb;
    const __global ushort* da = AT(const ushort, d_o) + (size_t)ra * nb;
    const __global ushort* db = AT(const ushort, d_o) + (size_t)rb * nb;
    const __global ushort* ma = AT(const ushort, m_o) + (size_t)ra * nb;
    const __global ushort* mb = AT(const ushort, m_o) + (size_t)rb * nb;
    const __global uchar* xv = AT(const uchar, s_o);
    const __global float* dx = AT(const float, s_o + (ulong)ACT_BYTES * K);
    const __global float* sx = dx + nb;
    float8 aa = 0.0f, ab = 0.0f, ma8 = 0.0f, mb8 = 0.0f;
    float sa = 0.0f, sb = 0.0f;
    int b = 0;
    for (; b + 8 <= nb; b += 8) {       // 8 blocks: their scales converted as one vector each
        const float8 dx8 = LOAD8(dx + b), sx8 = LOAD8(sx + b);
        float sca[8] __attribute__((aligned(32))), scb[8] __attribute__((aligned(32)));
        *(float8*)sca = HALF8(da + b) * dx8;
        *(float8*)scb = HALF8(db + b) * dx8;
        ma8 += HALF8(ma + b) * sx8;
        mb8 += HALF8(mb + b) * sx8;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            aa += block_dot(qa[b + j], xv, b + j) * sca[j];
            ab += block_dot(qb[b + j], xv, b + j) * scb[j];
        }
    }
    for (; b < nb; b++) {
        aa += block_dot(qa[b], xv, b) * (HALF(da, b) * dx[b]);
        ab += block_dot(qb[b], xv, b) * (HALF(db, b) * dx[b]);
        sa += HALF(ma, b) * sx[b];
        sb += HALF(mb, b) * sx[b];
    }
    return (float2)(hsum8(aa + ma8) + sa, hsum8(ab + mb8) + sb);
}
#endif

#if (LIN_T & (LIN_T - 1)) || (LIN_R & (LIN_R - 1))
#error "LIN_T and LIN_R must be powers of two (row_sum and group_sum reduce by halves)"
#endif
#if LIN_T > 1 && !defined(W_FLT)
// A GPU (LIN_T > 1): rows ra and rb times the prepared activation, their blocks dealt over the
// LIN_T work-items of dimension 0 (b = t, t + LIN_T, ...) and summed in local memory (part:
// [2 * LIN_T] of this row pair). Every work-item of the group must call it (barriers).
inline float2 dot2_t(__global uchar* arena, ulong qs_o, ulong d_o, ulong m_o, int ra, int rb,
                     int K, ulong s_o, int t, __local float* part)
{
    const int nb = K / QK;
    const __global uchar16* qa = AT(const uchar16, qs_o) + (size_t)ra * nb;
    const __global uchar16* qb = AT(const uchar16, qs_o) + (size_t)rb * nb;
    const __global uchar* xv = AT(const uchar, s_o);
    const __global float* dx = AT(const float, s_o + (ulong)ACT_BYTES * K);
    const __global float* sx = dx + nb;
    float8 aa = 0.0f, ab = 0.0f;
    float sa = 0.0f, sb = 0.0f;
#if W_Q4_1
    const __global ushort* da = AT(const ushort, d_o) + (size_t)ra * nb;
    const __global ushort* db = AT(const ushort, d_o) + (size_t)rb * nb;
    const __global ushort* ma = AT(const ushort, m_o) + (size_t)ra * nb;
    const __global ushort* mb = AT(const ushort, m_o) + (size_t)rb * nb;
    for (int b = t; b < nb; b += LIN_T) {
        aa += block_dot(qa[b], xv, b) * (HALF(da, b) * dx[b]);
        ab += block_dot(qb[b], xv, b) * (HALF(db, b) * dx[b]);
        sa += HALF(ma, b) * sx[b];
        sb += HALF(mb, b) * sx[b];
    }
#else
    const __global wsc_t* da = AT(const wsc_t, d_o) + (size_t)ra * nb * 2 * WGB;
    const __global wsc_t* db = AT(const wsc_t, d_o) + (size_t)rb * nb * 2 * WGB;
    const __global uchar* ma = AT(const uchar, m_o) + (size_t)ra * nb * WHB;
    const __global uchar* mb = AT(const uchar, m_o) + (size_t)rb * nb * WHB;
    for (int b = t; b < nb; b += LIN_T) {
        aa += w_block_dot(qa, da, ma, b, xv, dx, sx, &sa);
        ab += w_block_dot(qb, db, mb, b, xv, dx, sx, &sb);
    }
#endif
    const float x = row_sum(hsum8(aa) + sa, part, t);
    return (float2)(x, row_sum(hsum8(ab) + sb, part + LIN_T, t));
}

// ROW_PAIR: the row pair (r0, r1) of a GEMV work-item; PAIR_DOT: the pair's dot products with a
// weight. On a GPU the pair's LIN_T work-items share them and only work-item 0 (`mine`) writes;
// on a CPU one work-item takes the pair. global (LIN_T, ceil(M / 2) rounded up to LIN_R),
// local (LIN_T, LIN_R) (LIN_T is 1 on a CPU: gpu/fused.py FusedCL._rows)
#define ROW_PAIR(M) \
    const int t = get_local_id(0), r0 = 2 * get_global_id(1); \
    __local float part_[LIN_R][2 * LIN_T]; \
    const int r1 = r0 + 1 < M ? r0 + 1 : M - 1, ra_ = r0 < M ? r0 : M - 1, mine = t == 0 && r0 < M
#define PAIR_DOT(qs, d, m, K) dot2_t(arena, qs, d, m, ra_, r1, K, s_o, t, part_[get_local_id(1)])
#elif !defined(W_FLT)
#define ROW_PAIR(M) \
    const int r0 = 2 * get_global_id(1); \
    const int r1 = r0 + 1 < M ? r0 + 1 : M - 1, mine = r0 < M
#define PAIR_DOT(qs, d, m, K) (mine ? dot2(arena, qs, d, m, r0, r1, K, s_o) : (float2)0.0f)
#endif

// prep: x [K] -> act.  global (K/32 rounded up)
__kernel void prep(__global uchar* arena, ulong x_o, ulong s_o, int K)
{
    const int b = get_global_id(0);
    if (b >= K / QK) return;
    const __global float8* x = AT(const float8, x_o) + 4 * b;
    prep_block(x[0], x[1], x[2], x[3], arena, s_o, K, b, 0);
}

// norm_prep: x [D], w [D] -> act of rmsnorm(x) (as kernels.cl's rmsnorm computes it); also
// stored at out_o when store != 0 (another op reads it). natural != 0: values in their own order
// (for lm_head_act's Q8_0 rows), not evens/odds.  global (1): D is small
inline void norm_prep_row(__global uchar* arena, ulong x_o, ulong w_o, ulong s_o, ulong out_o,
                          int D, float eps, int store, int natural)
{
    const __global float8* x = AT(const float8, x_o);
    const __global float8* w = AT(const float8, w_o);
    __global float8* out = AT(float8, out_o);
    float8 acc = 0.0f;
    for (int j = 0; j < D / 8; j++) acc += x[j] * x[j];
    const float r = 1.0f / sqrt(hsum8(acc) / (float)D + eps);
    for (int b = 0; b < D / QK; b++) {
        const float8 y0 = x[4 * b] * r * w[4 * b], y1 = x[4 * b + 1] * r * w[4 * b + 1];
        const float8 y2 = x[4 * b + 2] * r * w[4 * b + 2], y3 = x[4 * b + 3] * r * w[4 * b + 3];
        prep_block(y0, y1, y2, y3, arena, s_o, D, b, natural);
        if (store) {
            out[4 * b] = y0, out[4 * b + 1] = y1, out[4 * b + 2] = y2, out[4 * b + 3] = y3;
        }
    }
}

#if LIN_T > 1
// A GPU's epilogues run over a whole work-group (n work-items, this one lid): their rows were
// written by other work-groups of the launch, so they are read volatile (past a stale L1 line).
// the 32 floats of block b of x
inline void load_block(const volatile __global float* x, int b, float8* y)
{
    float v[QK];
    for (int j = 0; j < QK; j++) v[j] = x[b * QK + j];
    for (int c = 0; c < 4; c++)
        y[c] = (float8)(v[8 * c], v[8 * c + 1], v[8 * c + 2], v[8 * c + 3], v[8 * c + 4],
                        v[8 * c + 5], v[8 * c + 6], v[8 * c + 7]);
}

// the sum of s over the group's n work-items (a power of two; part: [n] of local memory)
inline float group_sum(float s, __local float* part, int lid, int n)
{
    part[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int h = n / 2; h > 0; h /= 2) {
        if (lid < h) part[lid] += part[lid + h];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float total = part[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return total;
}

// x [D] -> act (prep), its blocks dealt over the group
inline void prep_group(__global uchar* arena, const volatile __global float* x, ulong s_o, int D,
                       int lid, int n)
{
    for (int b = lid; b < D / QK; b += n) {
        float8 y[4];
        load_block(x, b, y);
        prep_block(y[0], y[1], y[2], y[3], arena, s_o, D, b, 0);
    }
}

// norm_prep_row over the group
inline void norm_prep_group(__global uchar* arena, const volatile __global float* x, ulong w_o,
                            ulong s_o, ulong out_o, int D, float eps, int store, int natural,
                            int lid, int n, __local float* part)
{
    float acc = 0.0f;
    for (int j = lid; j < D; j += n) acc += x[j] * x[j];
    const float r = 1.0f / sqrt(group_sum(acc, part, lid, n) / (float)D + eps);
    const __global float8* w = AT(const float8, w_o);
    __global float8* out = AT(float8, out_o);
    for (int b = lid; b < D / QK; b += n) {
        float8 y[4];
        load_block(x, b, y);
        for (int c = 0; c < 4; c++) y[c] = y[c] * r * w[4 * b + c];
        prep_block(y[0], y[1], y[2], y[3], arena, s_o, D, b, natural);
        if (store) for (int c = 0; c < 4; c++) out[4 * b + c] = y[c];
    }
}
#endif

__kernel void norm_prep(__global uchar* arena, ulong x_o, ulong w_o, ulong s_o, ulong out_o,
                        int D, float eps, int store, int natural)
{
#if LIN_T > 1       // a GPU: one work-group of LIN_T work-items (global (LIN_T), local (LIN_T))
    __local float part[LIN_T];
    norm_prep_group(arena, (const volatile __global float*)AT(const float, x_o), w_o, s_o, out_o,
                    D, eps, store, natural, get_local_id(0), LIN_T, part);
#else
    norm_prep_row(arena, x_o, w_o, s_o, out_o, D, eps, store, natural);
#endif
}

// rope_table: cos [hd/2] then sin [hd/2] of position pos0 at t_o (the rope kernel's formula);
// pw_o != 0: pos0 is the int at pw_o (the step's position word: no argument moves between
// steps, and setting one costs an NVIDIA launch ~15 us).  global (hd/2)
__kernel void rope_table(__global uchar* arena, ulong t_o, int hd, float theta, int pos0, ulong f_o,
                         ulong pw_o)
{
    const int i = get_global_id(0);
    const int p = pw_o ? AT(const int, pw_o)[0] : pos0;
    const float ang = rope_angle((float)p, i, hd, theta, arena, f_o);
    AT(float, t_o)[i] = cos(ang);
    AT(float, t_o)[hd / 2 + i] = sin(ang);
}

#ifndef W_FLT
// linear_act: act [K], W Q4_1 [M, K] -> out [M] = W act (+ res [M] when add != 0; out may be
// res itself or a KV row).  ROW_PAIR's geometry
// rows_o != 0: out is a KV cache's base and the row goes to KV row rows[0] (paged KV: a V
// projection not joined into qkv_rope, its weights in another format than Q's and K's)
__kernel void linear_act(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o,
                         ulong out_o, ulong res_o, int K, int M, int add, ulong rows_o)
{
    ROW_PAIR(M);
    float2 y = PAIR_DOT(qs_o, d_o, m_o, K);
    if (!mine) return;
    if (add) y += (float2)(AT(const float, res_o)[r0], AT(const float, res_o)[r1]);
    if (rows_o) {
        __global kv_t* kv = AT(kv_t, out_o) + (size_t)AT(const int, rows_o)[0] * M;
        KV_PUT(kv, r0, y.x);
        if (r0 + 1 < M) KV_PUT(kv, r0 + 1, y.y);
        return;
    }
    AT(float, out_o)[r0] = y.x;
    if (r0 + 1 < M) AT(float, out_o)[r0 + 1] = y.y;
}
#endif

#ifndef W_FLT
// qkv_rope: act [K] -> q [Mq] roped, k [Mk] roped, v [Mk] (k_out, v_out: KV rows pos0, or the
// caches' bases and rows_o: KV row rows[0]). The three
// weights' rows are one index space (q, then k, then v); a work-item takes rows (2i, 2i+1), which
// are one GGML NORM RoPE pair (Mq, Mk and hd are even). t_o: rope_table of this step's position.
// ROW_PAIR's geometry over Mq + 2 Mk rows
__kernel void qkv_rope(__global uchar* arena, ulong s_o,
                       ulong q_qs, ulong q_d, ulong q_m, ulong k_qs, ulong k_d, ulong k_m,
                       ulong v_qs, ulong v_d, ulong v_m, ulong q_out, ulong k_out, ulong v_out,
                       ulong t_o, int K, int Mq, int Mk, int hd, ulong rows_o)
{
    const int all = Mq + 2 * Mk, pair = 2 * get_global_id(1);
    int r = pair < all ? pair : all - 2;     // clamped: every work-item of a GPU group reduces
    ulong qs = q_qs, d = q_d, m = q_m, out = q_out;
    int rope = 1;
    if (r >= Mq + Mk) {
        r -= Mq + Mk, qs = v_qs, d = v_d, m = v_m, out = v_out, rope = 0;
    } else if (r >= Mq) {
        r -= Mq, qs = k_qs, d = k_d, m = k_m, out = k_out;
    }
#if LIN_T > 1
    __local float part_[LIN_R][2 * LIN_T];
    float2 y = dot2_t(arena, qs, d, m, r, r + 1, K, s_o, get_local_id(0), part_[get_local_id(1)]);
    if (get_local_id(0) != 0 || pair >= all) return;
#else
    if (pair >= all) return;
    float2 y = dot2(arena, qs, d, m, r, r + 1, K, s_o);
#endif
    if (rope) {
        const int i = (r % hd) / 2;
        const float c = AT(const float, t_o)[i], s = AT(const float, t_o)[hd / 2 + i];
        y = (float2)(y.x * c - y.y * s, y.x * s + y.y * c);
    }
    if (out != q_out && rows_o) {   // paged KV (paged.cl): K and V go to KV row rows[0]
        __global kv_t* kv = AT(kv_t, out) + (size_t)AT(const int, rows_o)[0] * Mk;
        KV_PUT(kv, r, y.x);
        KV_PUT(kv, r + 1, y.y);
        return;
    }
    AT(float, out)[r] = y.x;
    AT(float, out)[r + 1] = y.y;
}
#endif

#ifndef W_FLT
// gate_up_silu: act [K], W_gate, W_up Q4_1 [M, K] -> out [M] = silu(W_gate act) * (W_up act).
// ROW_PAIR's geometry
__kernel void gate_up_silu(__global uchar* arena, ulong s_o, ulong g_qs, ulong g_d, ulong g_m,
                           ulong u_qs, ulong u_d, ulong u_m, ulong out_o, int K, int M)
{
    ROW_PAIR(M);
    const float2 g = PAIR_DOT(g_qs, g_d, g_m, K);
    const float2 u = PAIR_DOT(u_qs, u_d, u_m, K);
    if (!mine) return;
    AT(float, out_o)[r0] = g.x / (1.0f + exp_f32(-g.x)) * u.x;
    if (r0 + 1 < M) AT(float, out_o)[r0 + 1] = g.y / (1.0f + exp_f32(-g.y)) * u.y;
}
#endif

// sum_j q_j x_j of a Q8_0 block (32 int8 weights, natural order) against natural-order act block b
inline float8 block_dot_q8_0(const __global char16* q, const __global uchar* act, int b)
{
    const char16 q0 = q[0], q1 = q[1];
#if ACT_BITS == 8 && defined(Q8_X86)
    // s8 * s8 with pmaddubsw (u8 * s8): |w| times x with w's sign moved onto x (llama.cpp's trick)
    const v32qi w = __builtin_astype((char32)(q0, q1), v32qi);
    const v32qi x = *((const __global v32qi*)act + b);
    return CVT(DOT_U8S8(__builtin_ia32_psignb256(w, w),     // |w| (-128: 0x80 = 128 unsigned)
                        __builtin_ia32_psignb256(x, w)), float8);
#else
    return dot_halves(CVT(q0, short16), CVT(q1, short16), act, b);
#endif
}

// lm_head_act: act [D] (natural order), table Q8_0 [V, D] -> out [V]; a row a work-item (two
// rows with 8-block scale vectors, as in dot2, measured 1.5-2x slower here: register spills).
// global (V rounded up to 64), local (64); on a GPU (LIN_T > 1) a row's blocks are dealt over
// LIN_T work-items: global (LIN_T, V rounded up to LIN_R), local (LIN_T, LIN_R)
__kernel void lm_head_act(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong out_o,
                          int D, int V)
{
#if LIN_T > 1
    const int t = get_local_id(0), r = get_global_id(1), rr = r < V ? r : V - 1;
#else
    const int t = 0, r = get_global_id(0), rr = r;
    if (r >= V) return;
#endif
    const int nb = D / QK;
    const __global char16* q = AT(const char16, qs_o) + (size_t)rr * (D / 16);
    const __global ushort* d = AT(const ushort, d_o) + (size_t)rr * nb;
    const __global uchar* xv = AT(const uchar, s_o);
    const __global float* dx = AT(const float, s_o + (ulong)ACT_BYTES * D);
    float8 acc = 0.0f;
    for (int b = t; b < nb; b += LIN_T)
        acc += block_dot_q8_0(q + 2 * b, xv, b) * (HALF(d, b) * dx[b]);
#if LIN_T > 1
    __local float part[LIN_R][LIN_T];
    const float y = row_sum(hsum8(acc), part[get_local_id(1)], t);
    if (t == 0 && r < V) AT(float, out_o)[r] = y;
#else
    AT(float, out_o)[r] = hsum8(acc);
#endif
}
