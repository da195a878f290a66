// socllm's OpenCL kernels: the 8 ops of actors/cpu/kernels.py (their specification), op for op.
//
// Every tensor lives in ONE buffer, the pool's arena, addressed by byte offsets: f32 activations and
// KV rows, Q4_1 / Q8_0 weights in the planar layout of models/quant.py. Weights stay quantized in
// memory (W4A16): each 32-block is dequantized in registers, all sums are f32.
//
// Written for PoCL on a CPU first, portable OpenCL C throughout:
//  - one work-item owns whole output rows and works in float8 vectors (AVX2 width) inside them;
//  - no OpenCL builtins in inner loops (vloadN, fma, shuffle, vload_half): PoCL 3.0's distro build
//    compiles its builtin library for another target CPU than the kernel, so LLVM will not inline
//    them and a call costs more than the arithmetic around it. Loads are aligned vector
//    dereferences instead: vector-read tensors start at multiples of 32 bytes (the pool aligns to
//    64), K and D are multiples of 32 and head_dim of 8, so every float8 / uchar16 is aligned.
//    exp is inlined below; pow / cos / sin / sqrt are called once per row or pair, outside loops.
//  - LIN_T > 1 (a real GPU) splits each GEMV row over LIN_T work-items and reduces in local memory.

#define QK 32

#ifndef LIN_T        // work-items sharing one GEMV row (a power of two)
#define LIN_T 1
#endif
#ifndef LIN_R        // GEMV rows per work-group
#define LIN_R 8
#endif
#ifndef GEMM_TN      // tokens per GEMM work-item: each dequantized block is reused GEMM_TN times
#define GEMM_TN 8
#endif
#ifndef ATT_WG       // work-items splitting one attention row's keys (split-K)
#define ATT_WG 1
#endif
#ifndef HEAD_DIM     // attention head size, a multiple of 8 (CLKernels builds one per size)
#define HEAD_DIM 64
#endif
#define HC (HEAD_DIM / 8)

#define AT(T, off) ((__global T*)(arena + (off)))

// vector conversion (C rounding: toward zero for float -> int) that clang emits inline
#ifdef __clang__
#define CVT(x, T) __builtin_convertvector((x), T)
#else
#define CVT(x, T) convert_##T(x)
#endif

// a * b + c of vectors, fused into one vfmadd (OpenCL C contracts a * b + c: clang's -ffp-contract
// defaults to on for it); PoCL's float16 fma() is a call, which spills every vector register around
// it (q16 weight tiles: 72 calls a block loop, the tiles' accumulators and words on the stack)
#define FMAV(a, b, c) ((a) * (b) + (c))

// f16 -> f32 of element i of a ushort array: one instruction with x86 F16C, else vload_half
#if defined(__F16C__) && defined(__clang__) && !defined(SOCLLM_PORTABLE)
#define HALF(p, i) (__builtin_ia32_vcvtph2ps((short8)((short)(p)[i], 0, 0, 0, 0, 0, 0, 0))[0])
#else
#define HALF(p, i) vload_half((i), (const __global half*)(p))
#endif

// KV rows (memory/layout.py kv_dtype): f32, or f16 with -DKV_HALF (half the bytes attention reads;
// served precisions below f32). kv8: 8 elements of a row; KV8(p) the kv8 at p as float8 (one F16C
// instruction on x86); KV_PUT(p, i, x) / KV_PUT8(p, i, x8) store element i (.. i+7; i % 8 == 0) of
// the rows at p, rounded to nearest even like numpy's astype(float16). f16 KV rows are written
// only through a row map (rows_o: paged KV); contiguous KV writes (one-shot programs) are f32.
#ifdef KV_HALF
typedef ushort8 kv8;
typedef ushort kv_t;
#if defined(__F16C__) && defined(__clang__) && !defined(SOCLLM_PORTABLE)
typedef float kv_v4sf __attribute__((__vector_size__(16)));
typedef float kv_v8sf __attribute__((__vector_size__(32)));
#define KV8(p) __builtin_astype(__builtin_ia32_vcvtph2ps256(as_short8(*(p))), float8)
#define KV_PUT(p, i, x) \
    ((p)[i] = (ushort)__builtin_ia32_vcvtps2ph(__builtin_astype((float4)(x), kv_v4sf), 0)[0])
#define KV_PUT8(p, i, x8) (*(__global ushort8*)((p) + (i)) = \
    __builtin_astype(__builtin_ia32_vcvtps2ph256(__builtin_astype((x8), kv_v8sf), 0), ushort8))
#else
#define KV8(p) vload_half8(0, (const __global half*)(p))
#define KV_PUT(p, i, x) vstore_half((x), (i), (__global half*)(p))
#define KV_PUT8(p, i, x8) vstore_half8((x8), 0, (__global half*)((p) + (i)))
#endif
#else
typedef float8 kv8;
typedef float kv_t;
#define KV8(p) (*(p))
#define KV_PUT(p, i, x) ((p)[i] = (x))
#define KV_PUT8(p, i, x8) vstore8((x8), 0, (p) + (i))
#endif

inline float hsum8(float8 v) { const float4 a = v.lo + v.hi; const float2 b = a.lo + a.hi; return b.x + b.y; }

// e^x inline (Cephes expf: Cody-Waite reduction, degree-6 polynomial, ~1 ulp on [-87, 88]);
// x is clamped there: e^-inf -> ~1e-38 instead of 0, which every caller here tolerates.
inline float exp_f32(float x)
{
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = x * 1.44269504089f;
    const float n = (float)(int)(t + (t >= 0.0f ? 0.5f : -0.5f));
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.0f) * as_float(((int)n + 127) << 23);
}

// ---- weight formats (models/quant.py): w = d * q + m per group, q an unsigned code -------------
// Q4_1 and Q4_0 (the default build): a weight's three offsets are its codes' nibbles [M, K/2] and
// its f16 d and m [M, K/32]. CLKernels builds one program per other format a model holds (W_WQ):
// the offsets are then its codes' low nibbles [M, K/2], its (d, m) pairs per group and its codes'
// high bits, WHB bytes per 32-block; W_ROW declares a row's three pointers either way (q, d, m:
// for W_WQ, d points at the pairs and m at the high bits).
//   WHB     0 (4-bit codes), 4 (5-bit: a u32, bit j = lane j's bit 4), 8 (6-bit: two such u32),
//           16 (8-bit: the high nibbles, sequential); lane j < 16 is weight 2j, 16 + j weight 2j+1
//   W_F32   d and m are f32 (the K-quants' products of two scales), else f16
//   W_G16   groups of 16 weights (Q6_K): a block's first and second halves scale apart
//   W_ZERO  (below)
#ifndef WHB
#define WHB 0
#endif
#ifndef W_ZERO      // m = -W_ZERO d for every group (Q5_0, Q8_0, Q6_K): codes minus W_ZERO are
#define W_ZERO 0    // the file's signed integers, and the integer dots need no minimum term
#endif
#ifdef W_F32
typedef float wsc_t;
#define WS(p, i) ((p)[i])
#else
typedef ushort wsc_t;
#define WS(p, i) HALF(p, i)
#endif
#ifdef W_G16
#define WGB 2               // groups per 32-block
#else
#define WGB 1
#endif
#ifdef W_FLT         // a float matrix [M, K] as in the file: 1 F16, 2 BF16, 3 F32 ("wt" refs)
#define W_Q4_1 0
#if W_FLT == 3
typedef float wflt_t;
#else
typedef ushort wflt_t;
#endif
#define W_ROW(r, nb) \
    const __global wflt_t* q = AT(const wflt_t, qs_o) + (size_t)(r) * (nb) * QK; \
    const __global float* d = 0; \
    const __global uchar* m = 0
#elif defined(W_WQ)
#define W_Q4_1 0
#define WD(p, g) WS(p, 2 * (g))        // group g's scale and minimum in the pairs
#define WM(p, g) WS(p, 2 * (g) + 1)
#define W_ROW(r, nb) \
    const __global uchar16* q = AT(const uchar16, qs_o) + (size_t)(r) * (nb); \
    const __global wsc_t* d = AT(const wsc_t, d_o) + (size_t)(r) * (nb) * 2 * WGB; \
    const __global uchar* m = AT(const uchar, m_o) + (size_t)(r) * (nb) * WHB
#else
#define W_Q4_1 1            // the layout the fast paths read
#define W_ROW(r, nb) \
    const __global uchar16* q = AT(const uchar16, qs_o) + (size_t)(r) * (nb); \
    const __global ushort* d = AT(const ushort, d_o) + (size_t)(r) * (nb); \
    const __global ushort* m = AT(const ushort, m_o) + (size_t)(r) * (nb)
#endif

#if WHB
// bits 0-15 of w -> 16 bytes of 0 or 1 (byte j: bit j)
inline uchar16 bits_to_bytes(uint w)
{
    const uchar a = w & 0xFF, c = (w >> 8) & 0xFF;
    const uchar16 v = (uchar16)(a, a, a, a, a, a, a, a, c, c, c, c, c, c, c, c);
    const uchar16 bit = (uchar16)(1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128);
    return as_uchar16((v & bit) != (uchar16)0) & (uchar16)1;
}

// the bits above the low nibble of block b's codes (h: the row's high bits), 0-15 each: *he
// those of the even weights, *ho of the odd ones (lanes 0-15 and 16-31)
inline void high_codes(const __global uchar* h, int b, uchar16* he, uchar16* ho)
{
#if WHB == 16
    const uchar16 v = ((const __global uchar16*)h)[b];
    *he = v & (uchar)0x0F;
    *ho = v >> (uchar)4;
#else
    const __global uint* w = (const __global uint*)h + (WHB / 4) * b;
    *he = bits_to_bytes(w[0]);
    *ho = bits_to_bytes(w[0] >> 16);
#if WHB == 8
    *he |= bits_to_bytes(w[1]) << (uchar)1;
    *ho |= bits_to_bytes(w[1] >> 16) << (uchar)1;
#endif
#endif
}
#endif

// One Q4_1 block: 16 bytes of sequential nibbles (byte i = q[2i] | q[2i+1] << 4) -> its 32
// weights w = d * q + m as four float8 (elements 0-7, 8-15, 16-23, 24-31).
inline void q4_block(uchar16 v, float d, float m, float8* w0, float8* w1, float8* w2, float8* w3)
{
    const uchar16 lo = v & (uchar)0x0F, hi = v >> (uchar)4;
    const uchar16 a = (uchar16)(lo.s0, hi.s0, lo.s1, hi.s1, lo.s2, hi.s2, lo.s3, hi.s3,
                                lo.s4, hi.s4, lo.s5, hi.s5, lo.s6, hi.s6, lo.s7, hi.s7);
    const uchar16 b = (uchar16)(lo.s8, hi.s8, lo.s9, hi.s9, lo.sa, hi.sa, lo.sb, hi.sb,
                                lo.sc, hi.sc, lo.sd, hi.sd, lo.se, hi.se, lo.sf, hi.sf);
    *w0 = convert_float8(a.lo) * d + m;
    *w1 = convert_float8(a.hi) * d + m;
    *w2 = convert_float8(b.lo) * d + m;
    *w3 = convert_float8(b.hi) * d + m;
}

#ifdef W_FLT
// 8 weights of a float row from p, as float8
inline float8 flt8(const __global wflt_t* p)
{
#if W_FLT == 3
    return *(const __global float8*)p;
#elif W_FLT == 2
    return as_float8(convert_uint8(*(const __global ushort8*)p) << 16);
#else
    return vload_half8(0, (const __global half*)p);
#endif
}

// Block b of a float weight row -> its 32 weights as four float8 in order
inline void w_block(const __global wflt_t* q, const __global float* d, const __global uchar* m,
                    int b, float8* w0, float8* w1, float8* w2, float8* w3)
{
    *w0 = flt8(q + QK * b), *w1 = flt8(q + QK * b + 8);
    *w2 = flt8(q + QK * b + 16), *w3 = flt8(q + QK * b + 24);
}
#elif !W_Q4_1
// Block b of a weight row in the build's format (q, d, m: W_ROW's pointers) -> its 32 weights as
// four float8 in order, computed as the numpy spec does.
inline void w_block(const __global uchar16* q, const __global wsc_t* d, const __global uchar* m,
                    int b, float8* w0, float8* w1, float8* w2, float8* w3)
{
    const float d0 = WD(d, WGB * b), m0 = WM(d, WGB * b);
#if WGB == 2
    const float d1 = WD(d, 2 * b + 1), m1 = WM(d, 2 * b + 1);
#else
    const float d1 = d0, m1 = m0;
#endif
    q4_block(q[b], 1.0f, 0.0f, w0, w1, w2, w3);
#if WHB
    uchar16 he, ho;
    float8 h0, h1, h2, h3;                 // the codes' high bits, times 16, in order
    high_codes(m, b, &he, &ho);
    q4_block(he | (ho << (uchar)4), 16.0f, 0.0f, &h0, &h1, &h2, &h3);
    *w0 += h0, *w1 += h1, *w2 += h2, *w3 += h3;
#endif
    *w0 = *w0 * d0 + m0;
    *w1 = *w1 * d0 + m0;
    *w2 = *w2 * d1 + m1;
    *w3 = *w3 * d1 + m1;
}
#endif

// embed_w: ids int32 [N], table [V, D] in the build's format -> out [N, D] = rows * scale.
// global (D rounded up, N)
__kernel void embed_w(__global uchar* arena, ulong ids_o, ulong qs_o, ulong d_o, ulong m_o,
                      ulong out_o, int D, float scale)
{
    const int j = get_global_id(0), n = get_global_id(1);
    if (j >= D) return;
    float y;
#ifdef W_FLT
    W_ROW(AT(const int, ids_o)[n], D / QK);
#if W_FLT == 3
    y = q[j];
#elif W_FLT == 2
    y = as_float((uint)q[j] << 16);
#else
    y = vload_half(j, (const __global half*)q);
#endif
#elif !W_Q4_1
    const int row = AT(const int, ids_o)[n], nb = D / QK, b = j / QK, e = j % QK;
    W_ROW(row, nb);
    int code = (((const __global uchar*)(q + b))[e / 2] >> (4 * (e & 1))) & 15;
#if WHB == 16
    code += 16 * ((m[16 * b + e / 2] >> (4 * (e & 1))) & 15);
#elif WHB
    const int lane = (e & 1) * 16 + e / 2;
    const __global uint* w = (const __global uint*)m + (WHB / 4) * b;
    code += 16 * ((w[0] >> lane) & 1);
#if WHB == 8
    code += 32 * ((w[1] >> lane) & 1);
#endif
#endif
    const int g = WGB * b + (WGB == 2 && e >= 16);
    y = (float)code * WD(d, g) + WM(d, g);
#else                                   // Q4_1 (and Q4_0 as Q4_1): sequential nibbles
    const int b = j / QK, e = j % QK;
    W_ROW(AT(const int, ids_o)[n], D / QK);
    const int code = (((const __global uchar*)(q + b))[e / 2] >> (4 * (e & 1))) & 15;
    y = (float)code * HALF(d, b) + HALF(m, b);
#endif
    AT(float, out_o)[(size_t)n * D + j] = y * scale;
}

// embed: ids int32 [N], table Q8_0 [V, D] -> out [N, D] = rows * scale.  global (D rounded up, N)
__kernel void embed(__global uchar* arena, ulong ids_o, ulong qs_o, ulong d_o, ulong out_o, int D,
                    float scale)
{
    const int j = get_global_id(0), n = get_global_id(1);
    if (j >= D) return;
    const size_t row = (size_t)AT(const int, ids_o)[n] * D;
    const float q = (float)AT(const char, qs_o)[row + j];
    AT(float, out_o)[(size_t)n * D + j] = q * HALF(AT(const ushort, d_o), row / QK + j / QK) * scale;
}

// rmsnorm: x [N, D], w [D] -> out [N, D] = x / sqrt(mean(x^2) + eps) * w.  global (N)
#if LIN_T > 1
// the sum of s over the LIN_T work-items sharing a GEMV row (part: that row's local scratch);
// every work-item of the group must call it (barriers)
inline float row_sum(float s, __local float* part, int t)
{
    part[t] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int h = LIN_T / 2; h > 0; h /= 2) {
        if (t < h) part[t] += part[t + h];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return part[0];
}
#endif

// global (N) on a CPU; on a GPU (LIN_T > 1) global (LIN_T, N), local (LIN_T, 1): a row's float8s
// dealt over the work-group, its sum of squares reduced in local memory (one work-item a row took
// 31 us a launch on an H100)
__kernel void rmsnorm(__global uchar* arena, ulong x_o, ulong w_o, ulong out_o, int D, float eps, int N)
{
#if LIN_T > 1
    const int t = get_local_id(0), n = get_global_id(1);
    __local float part[LIN_T];
#else
    const int t = 0, n = get_global_id(0);
    if (n >= N) return;
#endif
    const __global float8* x = AT(const float8, x_o) + (size_t)n * (D / 8);
    const __global float8* w = AT(const float8, w_o);
    __global float8* out = AT(float8, out_o) + (size_t)n * (D / 8);
    float8 acc = 0.0f;
    for (int j = t; j < D / 8; j += LIN_T) acc += x[j] * x[j];
#if LIN_T > 1
    const float ss = row_sum(hsum8(acc), part, t);
#else
    const float ss = hsum8(acc);
#endif
    const float r = 1.0f / sqrt(ss / (float)D + eps);
    for (int j = t; j < D / 8; j += LIN_T) out[j] = x[j] * r * w[j];
}


// linear, decode (N == 1): x [1, K], W Q4_1 [M, K] -> out [1, M] = x @ W.T.
// global (LIN_T, M rounded up to LIN_R), local (LIN_T, LIN_R).
__kernel void linear_gemv(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong m_o,
                          ulong out_o, int K, int M, ulong rows_o, ulong b_o)
{
    const int t = get_local_id(0), r = get_global_id(1);
    const int nb = K / QK, rr = r < M ? r : M - 1;   // clamped: all work-items reach the barrier
    W_ROW(rr, nb);
    const __global float8* x = AT(const float8, x_o);
    float8 a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;   // four chains hide the FMA latency
    for (int b = t; b < nb; b += LIN_T) {
        float8 w0, w1, w2, w3;
#if W_Q4_1
        q4_block(q[b], HALF(d, b), HALF(m, b), &w0, &w1, &w2, &w3);
#else
        w_block(q, d, m, b, &w0, &w1, &w2, &w3);
#endif
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
    if (t == 0 && r < M) {  // rows_o != 0: the row goes to KV row rows[0] (paged KV)
        const float y = b_o ? s + AT(const float, b_o)[r] : s;     // b_o != 0: a bias [M]
        if (rows_o) KV_PUT(AT(kv_t, out_o), (size_t)AT(const int, rows_o)[0] * M + r, y);
        else AT(float, out_o)[r] = y;
    }
}

// linear, prefill (N > 1): x [N, K], W Q4_1 [M, K] -> out [N, M] in rows ld wide (ld > M: a
// row-cut half writes its columns of the whole output; rows_o != 0: row n at rows[n]).
// global (M rounded up, ceil(N / GEMM_TN)): one work-item = one row of W times GEMM_TN tokens.
__kernel void linear_gemm(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong m_o,
                          ulong out_o, int K, int M, int N, int ld, ulong rows_o, ulong b_o)
{
    const int r = get_global_id(0), n0 = get_global_id(1) * GEMM_TN;
    if (r >= M) return;
    const int nb = K / QK;
    W_ROW(r, nb);
    const __global float8* x[GEMM_TN];
    float8 acc[GEMM_TN];
#pragma unroll
    for (int i = 0; i < GEMM_TN; i++) {   // tail tokens repeat row N-1; they are not stored
        x[i] = AT(const float8, x_o) + (size_t)(n0 + i < N ? n0 + i : N - 1) * (K / 8);
        acc[i] = 0.0f;
    }
    for (int b = 0; b < nb; b++) {
        float8 w0, w1, w2, w3;
#if W_Q4_1
        q4_block(q[b], HALF(d, b), HALF(m, b), &w0, &w1, &w2, &w3);
#else
        w_block(q, d, m, b, &w0, &w1, &w2, &w3);
#endif
#pragma unroll
        for (int i = 0; i < GEMM_TN; i++) {
            const __global float8* xb = x[i] + 4 * b;   // 4 FMAs a token: GEMM_TN chains
            acc[i] += w0 * xb[0];
            acc[i] += w1 * xb[1];
            acc[i] += w2 * xb[2];
            acc[i] += w3 * xb[3];
        }
    }
    const float bias = b_o ? AT(const float, b_o)[r] : 0.0f;
#pragma unroll
    for (int i = 0; i < GEMM_TN; i++)
        if (n0 + i < N && rows_o)   // token n goes to KV row rows[n] (paged KV, paged.cl)
            KV_PUT(AT(kv_t, out_o), (size_t)AT(const int, rows_o)[n0 + i] * ld + r, hsum8(acc[i]) + bias);
        else if (n0 + i < N)
            AT(float, out_o)[(size_t)(n0 + i) * ld + r] = hsum8(acc[i]) + bias;
}

// rope (GGML NORM): x [N, H*hd] -> out [N, H*hd] (may be KV rows; in place is fine): pair
// (2i, 2i+1) of every head of row n rotated by (pos0 + n) * theta^(-2i/hd).  global (hd/2, N)
// neox != 0: pairs (i, i + hd/2) (NEOX rope, Qwen2); f_o != 0: pair i's frequency divided by
// f[i] (Llama 3.1's rope_freqs).
inline float rope_angle(float pos, int i, int hd, float theta, __global uchar* arena, ulong f_o)
{
    const float a = pos * pow(theta, -(float)(2 * i) / (float)hd);
    return f_o ? a / AT(const float, f_o)[i] : a;
}

__kernel void rope(__global uchar* arena, ulong x_o, ulong out_o, int H, int hd, float theta, int pos0,
                   int neox, ulong f_o)
{
    const int i = get_global_id(0), n = get_global_id(1);
    const float ang = rope_angle((float)(pos0 + n), i, hd, theta, arena, f_o);
    const float c = cos(ang), s = sin(ang);       // once per (row, pair), shared by the H heads
    const int a = neox ? i : 2 * i, b = neox ? i + hd / 2 : 2 * i + 1;
    const __global float* x = AT(const float, x_o) + (size_t)n * H * hd;
    __global float* out = AT(float, out_o) + (size_t)n * H * hd;
    for (int h = 0; h < H; h++) {
        const float v0 = x[h * hd + a], v1 = x[h * hd + b];
        out[h * hd + a] = v0 * c - v1 * s;
        out[h * hd + b] = v0 * s + v1 * c;
    }
}

// e^x of 8 lanes, exp_f32 lane for lane (same reduction, polynomial and clamp)
// exp_f32 for 8 lanes at once (attention's inner loop): the same polynomial, kept as a second
// copy because PoCL here cannot inline a library vector exp and scalar calls per lane cost 8x.
inline float8 exp8_f32(float8 x)
{
    x = x < (float8)-87.0f ? (float8)-87.0f : (x > (float8)88.0f ? (float8)88.0f : x);
    const float8 t = x * 1.44269504089f;
    const int8 ni = CVT(t + as_float8((as_int8(t) & (int8)0x80000000) | as_int8((float8)0.5f)), int8);
    const float8 n = CVT(ni, float8);
    const float8 r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float8 p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.0f) * as_float8((ni + 127) << 23);
}

// attention's helpers. q . k_j for 4 keys j, HC float8 each, as 4 independent chains; the result's
// lanes (2j, 2j+1) hold two halves of key j's sum (a transposed reduction, no hsum8 per key)
inline float8 dot4(const __global float8* q, const __global kv8* k0, const __global kv8* k1,
                   const __global kv8* k2, const __global kv8* k3)
{
    float8 d0 = q[0] * KV8(k0), d1 = q[0] * KV8(k1), d2 = q[0] * KV8(k2), d3 = q[0] * KV8(k3);
#pragma unroll
    for (int c = 1; c < HC; c++) {
        d0 += q[c] * KV8(k0 + c);
        d1 += q[c] * KV8(k1 + c);
        d2 += q[c] * KV8(k2 + c);
        d3 += q[c] * KV8(k3 + c);
    }
    const float8 p01 = (float8)(d0.even, d1.even) + (float8)(d0.odd, d1.odd);
    const float8 p23 = (float8)(d2.even, d3.even) + (float8)(d2.odd, d3.odd);
    return (float8)(p01.even, p23.even) + (float8)(p01.odd, p23.odd);
}

// The first key a row of L keys sees in a sliding window of win keys (win 0: no window)
inline int win_start(int L, int win)
{
    return win > 0 && L > win ? L - win : 0;
}

// The online softmax's running max *mx raised to the largest of s, if larger: what is summed so
// far (sum, acc [HC]) rescaled by e^(old max - new max)
inline void att_max(float8 s, float* mx, float* sum, float8* acc)
{
    const float4 m4 = s.lo > s.hi ? s.lo : s.hi;
    const float2 m2 = m4.lo > m4.hi ? m4.lo : m4.hi;
    const float top = m2.x > m2.y ? m2.x : m2.y;
    if (top > *mx) {
        const float a = exp_f32(*mx - top);
        *sum *= a;
#pragma unroll
        for (int c = 0; c < HC; c++) acc[c] *= a;
        *mx = top;
    }
}

// One online-softmax step over keys l .. l+7 (those in lo .. L-1) for one query row q: scores as
// one float8, one vector exp, at most one rescale of (mx, sum, acc). Keys past L - 1 are not read.
inline void att_step8(const __global float8* q, const __global kv8* k, const __global kv8* v,
                      int kw, int l, int lo, int L, float rsq, float* mx, float* sum, float8* acc)
{
    const __global kv8* kr[8];
    const __global kv8* vr[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const size_t row = l + j < L ? l + j : L - 1;         // tail: re-read a valid row
        kr[j] = k + row * kw;
        vr[j] = v + row * kw;
    }
    const float8 d0 = dot4(q, kr[0], kr[1], kr[2], kr[3]), d1 = dot4(q, kr[4], kr[5], kr[6], kr[7]);
    const int8 key = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + l;
    const int8 live = key < (int8)L && key >= (int8)lo;
    const float8 s = live ? ((float8)(d0.even, d1.even) + (float8)(d0.odd, d1.odd)) * rsq
                          : (float8)-INFINITY;
    att_max(s, mx, sum, acc);
    const float8 p = live ? exp8_f32(s - *mx) : (float8)0.0f;
    *sum += hsum8(p);
#pragma unroll
    for (int c = 0; c < HC; c++)
        acc[c] += ((p.s0 * KV8(vr[0] + c) + p.s1 * KV8(vr[1] + c))
                   + (p.s2 * KV8(vr[2] + c) + p.s3 * KV8(vr[3] + c)))
                + ((p.s4 * KV8(vr[4] + c) + p.s5 * KV8(vr[5] + c))
                   + (p.s6 * KV8(vr[6] + c) + p.s7 * KV8(vr[7] + c)));
}

// out [HC] = the work-group's partial softmaxes merged (online-softmax style): partial t weighs
// exp(mx_t - M), M the group's max. Work-item 0 always has key 0, so M is finite; an empty partial
// (mx = -inf) weighs ~1e-38 * 0 = 0. part_*: the kernel's __local scratch [ATT_WG] / [ATT_WG * HC].
inline void att_store(__global float8* out, int t, float mx, float sum, float8* acc,
                      __local float* part_mx, __local float* part_sum, __local float8* part_acc)
{
#if ATT_WG > 1
    part_mx[t] = mx;
    barrier(CLK_LOCAL_MEM_FENCE);
    float M = part_mx[0];
    for (int i = 1; i < ATT_WG; i++) M = part_mx[i] > M ? part_mx[i] : M;
    const float w = exp_f32(mx - M);
    part_sum[t] = sum * w;
#pragma unroll
    for (int c = 0; c < HC; c++) part_acc[t * HC + c] = acc[c] * w;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int c = t; c < HC; c += ATT_WG) {
        float8 o = 0.0f;
        float z = 0.0f;
        for (int i = 0; i < ATT_WG; i++) {
            o += part_acc[i * HC + c];
            z += part_sum[i];
        }
        out[c] = o / z;
    }
#else
#pragma unroll
    for (int c = 0; c < HC; c++) out[c] = acc[c] / sum;
#endif
}

// attention: q [N, H*hd], K/V cache [pos0+N, KVH*hd] -> out [N, H*hd]; causal (row n sees keys
// 0 .. pos0+n; with a window win > 0 only the last win of them: a sliding-window layer), GQA (head h reads kv head h / (H/KVH)), online softmax in f32.
// global (ATT_WG, H, N), local (ATT_WG, 1, 1): one work-group per (head, query row). Split-K
// ("flash-decoding") when ATT_WG > 1: work-item t takes the 8-key blocks t, t + ATT_WG, ... with
// an online softmax of its own (max, sum, weighted V); the group merges the partials in local
// memory. A GPU needs that to fill its lanes at decode (N = 1: only H work-groups); on a CPU a
// work-group runs on one thread, so ATT_WG = 1 there: no merge, the whole row in one loop.
__kernel void attention(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong out_o,
                        int H, int KVH, int pos0, int win)
{
    const int t = get_local_id(0), h = get_global_id(1), n = get_global_id(2);
    const int kv = h / (H / KVH), kw = KVH * HC;              // KV row stride in kv8
    const __global float8* q = AT(const float8, q_o) + ((size_t)n * H + h) * HC;
    const __global kv8* k = AT(const kv8, k_o) + kv * HC;
    const __global kv8* v = AT(const kv8, v_o) + kv * HC;
    const float rsq = 1.0f / sqrt((float)HEAD_DIM);
    const int L = pos0 + n + 1, lo = win_start(L, win);
    float8 acc[HC];
#pragma unroll
    for (int c = 0; c < HC; c++) acc[c] = 0.0f;
    float mx = -INFINITY, sum = 0.0f;
    for (int l = (lo & ~7) + 8 * t; l < L; l += 8 * ATT_WG)
        att_step8(q, k, v, kw, l, lo, L, rsq, &mx, &sum, acc);
    __local float part_mx[ATT_WG], part_sum[ATT_WG];
    __local float8 part_acc[ATT_WG * HC];
    att_store(AT(float8, out_o) + ((size_t)n * H + h) * HC, t, mx, sum, acc, part_mx, part_sum,
              part_acc);
}

// silu_mul: g, u [count] -> out = silu(g) * u.  global (count rounded up)
__kernel void silu_mul(__global uchar* arena, ulong g_o, ulong u_o, ulong out_o, int count)
{
    const int i = get_global_id(0);
    if (i >= count) return;
    const float g = AT(const float, g_o)[i];
    AT(float, out_o)[i] = g / (1.0f + exp_f32(-g)) * AT(const float, u_o)[i];
}

// gelu_mul: g, u [count] -> out = gelu(g) * u, GELU's tanh form (GeGLU).  global (count rounded up)
__kernel void gelu_mul(__global uchar* arena, ulong g_o, ulong u_o, ulong out_o, int count)
{
    const int i = get_global_id(0);
    if (i >= count) return;
    const float g = AT(const float, g_o)[i];
    const float t = tanh(0.7978845608f * (g + 0.044715f * g * g * g));
    AT(float, out_o)[i] = 0.5f * g * (1.0f + t) * AT(const float, u_o)[i];
}

// add: a, b [count] -> out = a + b.  global (count rounded up)
__kernel void add(__global uchar* arena, ulong a_o, ulong b_o, ulong out_o, int count)
{
    const int i = get_global_id(0);
    if (i >= count) return;
    AT(float, out_o)[i] = AT(const float, a_o)[i] + AT(const float, b_o)[i];
}

// lm_head: x [N, D] (row N-1 used), table Q8_0 [V, D] -> out [V].  global (V rounded up)
__kernel void lm_head(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong out_o,
                      int D, int V, int N)
{
    const int r = get_global_id(0);
    if (r >= V) return;
    const int nb = D / QK;
    const __global float8* x = AT(const float8, x_o) + (size_t)(N - 1) * (D / 8);
    const __global char16* q = AT(const char16, qs_o) + (size_t)r * (D / 16);
    const __global ushort* d = AT(const ushort, d_o) + (size_t)r * nb;
    float8 acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const char16 q0 = q[2 * b], q1 = q[2 * b + 1];
        const float8 t = (convert_float8(q0.lo) * x[4 * b] + convert_float8(q0.hi) * x[4 * b + 1])
                       + (convert_float8(q1.lo) * x[4 * b + 2] + convert_float8(q1.hi) * x[4 * b + 3]);
        acc += t * HALF(d, b);
    }
    AT(float, out_o)[r] = hsum8(acc);
}
