// A decode batch's linears in int8 (precision q8) or int16 (q16, below), weight tile by weight
// tile (appended after paged.cl). linear_rows_act's way (a weight row against a row of
// activations, a horizontal sum per row) spends ~6 instructions per block and row on conversions
// and scaling; here a work-item takes a TILE of 8 weight rows, so each integer lane belongs to
// one weight row:
//   W_g   the dword g (bytes 4g .. 4g+3) of block b of the 8 rows, as one 256-bit vector:
//         low nibbles pair with the activation's evens 4g .. 4g+3, high nibbles with its odds
//   dot   8 u8 x s8 pair products (pmaddubsw) against an activation dword broadcast to all
//         lanes, summed in int16 (|sum| <= 8 * 2 * 15 * 127 < 2^15), then pairs to int32:
//         the block's 8 row sums in 17 instructions, no horizontal sum
//   scale acc += dot * (d_w * dx) + m_w * sx: one vector for the tile's 8 rows
// The tile's weight blocks are loaded, transposed and split once for tn activation rows.
//
// q16 (ACT_BITS 16, int16 activations) has its own linear_tile below: the same tiles, with the
// weights widened to int16 pairs and the products summed by vpdpwssd in 512-bit vectors.

// The rows a work-item takes against its weight tile (tn) are an argument of tile_rows, always
// inlined: each kernel below passes a constant, so its loops over the rows unroll and its
// accumulators stay in registers as they did when tn was a build's macro. One build per K holds
// the kernels of every tn (linear_tile_n<tn>, TILE_NS), where a build per (K, tn) held one each:
// ~2-4 MB of the GPU actor's memory a build on PoCL, 16 builds for SmolLM2's decode batches.
#ifndef TILE_N       // moe_tile's and moe_sort's rows a tile (cl/moe.cl): a build's macro
#define TILE_N 4
#endif
#define TILE_MAX 16  // the most rows a tile takes (TILE_NS' largest)
#define TILE_INLINE inline __attribute__((always_inline))

#if (ACT_BITS == 8 || ACT_BITS == 16) && defined(Q8_X86)
typedef uint uint8v __attribute__((ext_vector_type(8)));
// the dwords of block b of a tile's 8 weight rows (row j at q + j nb): w[g] lane j = dword g
// (bytes 4g .. 4g+3) of row j
inline void tile_words(const __global uint4* q, int nb, int b, uint8v* w)
{
    // rows (j, j+4) side by side, then a 4x4 dword transpose in each 128-bit half
    const uint8v a0 = __builtin_shufflevector(q[b], q[4 * nb + b], 0, 1, 2, 3, 4, 5, 6, 7);
    const uint8v a1 = __builtin_shufflevector(q[nb + b], q[5 * nb + b], 0, 1, 2, 3, 4, 5, 6, 7);
    const uint8v a2 = __builtin_shufflevector(q[2 * nb + b], q[6 * nb + b], 0, 1, 2, 3, 4, 5, 6, 7);
    const uint8v a3 = __builtin_shufflevector(q[3 * nb + b], q[7 * nb + b], 0, 1, 2, 3, 4, 5, 6, 7);
    const uint8v t0 = __builtin_shufflevector(a0, a1, 0, 8, 1, 9, 4, 12, 5, 13);   // unpacklo dq
    const uint8v t1 = __builtin_shufflevector(a0, a1, 2, 10, 3, 11, 6, 14, 7, 15);  // unpackhi dq
    const uint8v t2 = __builtin_shufflevector(a2, a3, 0, 8, 1, 9, 4, 12, 5, 13);
    const uint8v t3 = __builtin_shufflevector(a2, a3, 2, 10, 3, 11, 6, 14, 7, 15);
    w[0] = __builtin_shufflevector(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);             // qdq
    w[1] = __builtin_shufflevector(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    w[2] = __builtin_shufflevector(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
    w[3] = __builtin_shufflevector(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
}

// the f16 scales (d or m) of block b of a tile's 8 rows (row j at p + j nb), as f32: lane j row j's
inline float8 tile_scales(const __global ushort* p, int nb, int b)
{
    return __builtin_ia32_vcvtph2ps256((short8)(p[b], p[nb + b], p[2 * nb + b], p[3 * nb + b],
                                                p[4 * nb + b], p[5 * nb + b], p[6 * nb + b],
                                                p[7 * nb + b]));
}
#endif

// TILE_K: a build for one K (CLKernels builds one per K it meets): the rows of a tile and of the
// scratch are then constant displacements from one pointer each, not ~30 induction variables.
#ifdef TILE_K
#define TK TILE_K
#define TRB TILE_ROW_BYTES
#else
#define TK K
#define TRB row_bytes
#endif

// row n of a tile's output (8 values from column r0): KV row rows[n] when kv (paged KV), row
// rows[n] of out when a row map is given (an expert's rows: moe_tile), else row n; rows ld wide
inline void tile_store(__global uchar* arena, ulong out_o, int ld, ulong rows_o, int kv, int n,
                       int r0, float8 y)
{
    const size_t row = rows_o ? (size_t)AT(const int, rows_o)[n] : (size_t)n;
    if (kv)
        KV_PUT8(AT(kv_t, out_o), row * ld + r0, y);
    else
        vstore8(y, 0, AT(float, out_o) + row * ld + r0);
}

#if ACT_BITS == 8
#ifdef Q8_X86
// sum_j q_w * q_x of block b for the tile's 8 rows: lo / hi [4] the split tile, x the row's
// prepared block (16 evens, then 16 odds, int8)
#ifdef VNNI
// VNNI: one vpdpbusd sums 4 u8 x s8 products per lane into int32 (what pmaddubsw + pmaddwd do,
// without the int16 step)
inline int8 tile_dot(const v32qi* lo, const v32qi* hi, const __global int* x)
{
    v8si acc = __builtin_ia32_vpdpbusd256(__builtin_astype((int8)0, v8si), __builtin_astype(lo[0], v8si), __builtin_astype((int8)x[0], v8si));
#pragma unroll
    for (int g = 1; g < 4; g++)
        acc = __builtin_ia32_vpdpbusd256(acc, __builtin_astype(lo[g], v8si), __builtin_astype((int8)x[g], v8si));
#pragma unroll
    for (int g = 0; g < 4; g++)
        acc = __builtin_ia32_vpdpbusd256(acc, __builtin_astype(hi[g], v8si), __builtin_astype((int8)x[4 + g], v8si));
    return __builtin_astype(acc, int8);
}
#else
inline int8 tile_dot(const v32qi* lo, const v32qi* hi, const __global int* x)
{
    v16hi p = __builtin_ia32_pmaddubsw256(lo[0], __builtin_astype((int8)x[0], v32qi));
#pragma unroll
    for (int g = 1; g < 4; g++)
        p += __builtin_ia32_pmaddubsw256(lo[g], __builtin_astype((int8)x[g], v32qi));
#pragma unroll
    for (int g = 0; g < 4; g++)
        p += __builtin_ia32_pmaddubsw256(hi[g], __builtin_astype((int8)x[4 + g], v32qi));
    const v16hi ones = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    return __builtin_astype(__builtin_ia32_pmaddwd256(p, ones), int8);
}
#endif
#endif

// tile_rows (int8): a work-item's tile, the 8 weight rows from r0 of W Q4_1 [., K] (rows nb blocks
// from qs_o / d_o / m_o) against prepared rows n0 .. n0 + tn - 1 of the scratch at s_o (row i
// at s_o + i row_bytes), rows below N stored by tile_store. The scratch holds whole tiles (prep_rows
// repeats row N-1; moe_gather pads an expert's run), so a work-item's rows are one base and
// constant strides. TILE_K (above): a build for one K. linear_tile and moe_tile (cl/moe.cl) run it.
TILE_INLINE void tile_rows(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o,
                           ulong out_o, int K, int N, int ld, ulong rows_o, int kv, int row_bytes,
                           int r0, int n0, const int tn)
{
    const int nb = TK / QK;
    const __global uint4* q = AT(const uint4, qs_o) + (size_t)r0 * nb;    // row j, block b: q[j nb + b]
    const __global ushort* d = AT(const ushort, d_o) + (size_t)r0 * nb;
    const __global ushort* m = AT(const ushort, m_o) + (size_t)r0 * nb;
    const __global uchar* x0 = AT(const uchar, s_o + (ulong)n0 * TRB);   // row i at x0 + i TRB
    float8 acc[TILE_MAX];
#pragma unroll
    for (int i = 0; i < tn; i++) acc[i] = 0.0f;
    for (int b = 0; b < nb; b++) {
#ifdef Q8_X86
        const float8 dw = tile_scales(d, nb, b), mw = tile_scales(m, nb, b);
        uint8v w[4];
        tile_words(q, nb, b, w);
        v32qi lo[4], hi[4];
#pragma unroll
        for (int g = 0; g < 4; g++) {
            lo[g] = __builtin_astype(w[g] & (uint)0x0F0F0F0F, v32qi);
            hi[g] = __builtin_astype((w[g] >> 4) & (uint)0x0F0F0F0F, v32qi);
        }
#pragma unroll
        for (int i = 0; i < tn; i++) {   // row i: values [K], then dx [K/32], sx [K/32]
            const __global int* xb = (const __global int*)(x0 + i * TRB);
            const __global float* dx = (const __global float*)(xb + TK / 4);
            acc[i] += CVT(tile_dot(lo, hi, xb + 8 * b), float8) * (dw * dx[b]) + mw * dx[nb + b];
        }
#else
        float dws[8], mws[8];
        int sums[TILE_MAX][8];
        for (int j = 0; j < 8; j++) {
            dws[j] = HALF(d, j * nb + b);
            mws[j] = HALF(m, j * nb + b);
            const uchar16 wq = as_uchar16(q[j * nb + b]);
            const short16 wl = convert_short16(wq & (uchar)0x0F), wh = convert_short16(wq >> (uchar)4);
            for (int i = 0; i < tn; i++) {
                const __global char16* x = (const __global char16*)(x0 + i * TRB) + 2 * b;
                const short16 p = wl * convert_short16(x[0]) + wh * convert_short16(x[1]);
                const int8 s8 = convert_int8(p.lo) + convert_int8(p.hi);
                const int4 s4 = s8.lo + s8.hi;
                sums[i][j] = s4.x + s4.y + s4.z + s4.w;
            }
        }
        const float8 dw = vload8(0, dws), mw = vload8(0, mws);
        for (int i = 0; i < tn; i++) {
            const __global float* dx = (const __global float*)(x0 + i * TRB + TK);
            acc[i] += convert_float8(vload8(0, sums[i])) * (dw * dx[b]) + mw * dx[nb + b];
        }
#endif
    }
#pragma unroll
    for (int i = 0; i < tn; i++)
        if (n0 + i < N)
            tile_store(arena, out_o, ld, rows_o, kv, n0 + i, r0, acc[i]);
}
#endif

#if ACT_BITS == 8 && defined(Q8_X86) && defined(VNNI) && defined(__AVX512BW__)
// tile_rows16 (int8, AVX512-VNNI): tile_rows over 16 weight rows from r0, for a linear whose M is
// a multiple of 16 (linear_tile16 below). Lanes 0-7 are rows r0 .. r0+7 (tile_words
// of the first 8), lanes 8-15 the next 8, so one vpdpbusd512 sums 4 u8 x s8 products in each of 16
// lanes (64 a instruction, against 32 for the 256-bit form and for q16's vpdpwssd): the same
// integer sums as tile_dot, per row, and the same float steps per row as tile_rows. A q8 prefill
// chunk of 128 rows, 2 Emerald Rapids cores: 92-98 ms against 107-121 in tiles of 8 (position 0),
// 141-149 against 154-179 (position 384), four alternating runs each.
#define VNNI512 1
typedef int v16si8 __attribute__((__vector_size__(64)));
typedef uint uint16v __attribute__((ext_vector_type(16)));
TILE_INLINE void tile_rows16(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o,
                             ulong out_o, int K, int N, int ld, ulong rows_o, int kv, int row_bytes,
                             int r0, int n0, const int tn)
{
    const int nb = TK / QK;
    const __global uint4* q = AT(const uint4, qs_o) + (size_t)r0 * nb;    // row j, block b: q[j nb + b]
    const __global ushort* d = AT(const ushort, d_o) + (size_t)r0 * nb;
    const __global ushort* m = AT(const ushort, m_o) + (size_t)r0 * nb;
    const __global uchar* x0 = AT(const uchar, s_o + (ulong)n0 * TRB);   // row i at x0 + i TRB
    float16 acc[TILE_MAX];
#pragma unroll
    for (int i = 0; i < tn; i++) acc[i] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const float16 dw = (float16)(tile_scales(d, nb, b), tile_scales(d + 8 * nb, nb, b));
        const float16 mw = (float16)(tile_scales(m, nb, b), tile_scales(m + 8 * nb, nb, b));
        // the next tile's codes and scales (as q16's tile_rows: the weights stream from DRAM)
        __builtin_prefetch((const __global uchar*)(q + 16 * nb) + 256 * b);
        __builtin_prefetch((const __global uchar*)(q + 16 * nb) + 256 * b + 64);
        __builtin_prefetch((const __global uchar*)(q + 16 * nb) + 256 * b + 128);
        __builtin_prefetch((const __global uchar*)(q + 16 * nb) + 256 * b + 192);
        if (64 * b < 32 * nb) {
            __builtin_prefetch((const __global uchar*)(d + 16 * nb) + 64 * b);
            __builtin_prefetch((const __global uchar*)(m + 16 * nb) + 64 * b);
        }
        uint8v w0[4], w1[4];
        tile_words(q, nb, b, w0);
        tile_words(q + 8 * nb, nb, b, w1);
        v16si8 lo[4], hi[4];
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const uint16v w = __builtin_shufflevector(w0[g], w1[g], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                      10, 11, 12, 13, 14, 15);
            lo[g] = __builtin_astype(w & (uint)0x0F0F0F0F, v16si8);
            hi[g] = __builtin_astype((w >> 4) & (uint)0x0F0F0F0F, v16si8);
        }
#pragma unroll
        for (int i = 0; i < tn; i++) {   // row i: values [K], then dx [K/32], sx [K/32]
            const __global int* xb = (const __global int*)(x0 + i * TRB) + 8 * b;
            const __global float* dx = (const __global float*)(x0 + i * TRB + TK);
            v16si8 s = __builtin_ia32_vpdpbusd512(__builtin_astype((int16)0, v16si8), lo[0],
                                                  __builtin_astype((int16)xb[0], v16si8));
#pragma unroll
            for (int g = 1; g < 4; g++)
                s = __builtin_ia32_vpdpbusd512(s, lo[g], __builtin_astype((int16)xb[g], v16si8));
#pragma unroll
            for (int g = 0; g < 4; g++)
                s = __builtin_ia32_vpdpbusd512(s, hi[g], __builtin_astype((int16)xb[4 + g], v16si8));
            acc[i] += CVT(__builtin_astype(s, int16), float16) * (dw * dx[b]) + mw * dx[nb + b];
        }
    }
#pragma unroll
    for (int i = 0; i < tn; i++) {
        if (n0 + i < N) {
            tile_store(arena, out_o, ld, rows_o, kv, n0 + i, r0, acc[i].lo);
            tile_store(arena, out_o, ld, rows_o, kv, n0 + i, r0 + 8, acc[i].hi);
        }
    }
}
#endif

#if (ACT_BITS == 16 || ACT_BITS == 8) && defined(Q8_X86)
typedef int v16si __attribute__((__vector_size__(64)));
typedef short v32hi __attribute__((__vector_size__(64)));
// acc + the sum of each int lane's two int16 products: DOT16_FORM 2 one vpdpwssd (AVX512-VNNI),
// 1 pmaddwd and an add (AVX512BW), 0 those over two 256-bit halves (AVX2). The tests build the
// narrower forms on a VNNI machine too (-DDOT16_FORM=0 / 1). q16's tiles and both builds' LM
// head tiles (lm_head_tile) use it.
#ifndef DOT16_FORM
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DOT16_FORM 2
#elif defined(__AVX512BW__)
#define DOT16_FORM 1
#else
#define DOT16_FORM 0
#endif
#endif
#if DOT16_FORM == 2
#define DOT_W16(acc, w, x) __builtin_ia32_vpdpwssd512((acc), (w), (x))
#elif DOT16_FORM == 1
#define DOT_W16(acc, w, x) ((acc) + __builtin_ia32_pmaddwd512(__builtin_astype((w), v32hi), \
                                                              __builtin_astype((x), v32hi)))
#else
inline v16si DOT_W16(v16si acc, v16si w, v16si x)
{
    const int16 wi = __builtin_astype(w, int16), xi = __builtin_astype(x, int16);
    const v8si lo = __builtin_ia32_pmaddwd256(__builtin_astype(wi.lo, v16hi), __builtin_astype(xi.lo, v16hi));
    const v8si hi = __builtin_ia32_pmaddwd256(__builtin_astype(wi.hi, v16hi), __builtin_astype(xi.hi, v16hi));
    return acc + __builtin_astype((int16)(__builtin_astype(lo, int8), __builtin_astype(hi, int8)), v16si);
}
#endif
#endif

#if ACT_BITS == 16
// tile_rows at q16: prepared int16 rows, with the int8 tile_rows' geometry, scratch and
// arguments. The int16 products:
//   W_g   tile_words' dword g of the 8 rows (lane j: bytes 4g .. 4g+3 of row j), widened to 16
//         int16 (vpmovzxbw): int lane 2j+h holds bytes 4g+2h, 4g+2h+1 of row j, so its low
//         nibbles (& 0x0F) pair with the activation's evens 4g+2h, 4g+2h+1 and its high ones
//         (>> 4) with the odds 4g+2h, 4g+2h+1
//   dot   vpdpwssd against the activation's qword of evens 4g .. 4g+3 (or odds) broadcast to every
//         lane pair: 8 instructions give lane 2j+h the sum over the block's evens and odds of
//         index = 2h, 2h+1 (mod 4) for row j (16 products a lane: |sum| <= 16 * 15 * 32767 < 2^23,
//         exact in int32 and in f32)
//   scale acc += m_w' * sx, then += dot * (d_w * dx) (two fma), m_w' = m_w in lane 2j and 0 in
//         lane 2j+1; row j's result is lanes 2j + 2j+1 at the end
// Each integer product is linear_rows_act's (decode.cl dot_q4q16); only the float sums run in
// another order (per half-block lane pair, the pairs added last).
#ifdef Q8_X86
typedef ushort ushort32 __attribute__((ext_vector_type(32)));
#endif

TILE_INLINE void tile_rows(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o,
                           ulong out_o, int K, int N, int ld, ulong rows_o, int kv, int row_bytes,
                           int r0, int n0, const int tn)
{
    const int nb = TK / QK;
    const __global uint4* q = AT(const uint4, qs_o) + (size_t)r0 * nb;    // row j, block b: q[j nb + b]
    const __global ushort* d = AT(const ushort, d_o) + (size_t)r0 * nb;
    const __global ushort* m = AT(const ushort, m_o) + (size_t)r0 * nb;
    const __global uchar* x0 = AT(const uchar, s_o + (ulong)n0 * TRB);   // row i at x0 + i TRB
#ifdef Q8_X86
    float16 acc[TILE_MAX];
#pragma unroll
    for (int i = 0; i < tn; i++) acc[i] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const float8 dw8 = tile_scales(d, nb, b), mw8 = tile_scales(m, nb, b);
        const float16 dw = __builtin_shufflevector(dw8, dw8, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const float16 mw = __builtin_shufflevector(mw8, (float8)0.0f, 0, 8, 1, 8, 2, 8, 3, 8, 4, 8, 5, 8, 6, 8, 7, 8);
        // prefetch the next tile (the next work-item's, on this thread when it is in this
        // work-group): its codes (2 nb lines) 2 lines a block, its scales (nb / 4 lines each) a
        // line a block. The step's weights stream from DRAM; without this, tiles of more than 4
        // rows stalled on them (210 linears of 8 rows: 12.4 ms in tiles of 8, 9.1 in two of 4;
        // with it 7.1 and 7.5, on 2 loaded cores)
        __builtin_prefetch((const __global uchar*)(q + 8 * nb) + 128 * b);
        __builtin_prefetch((const __global uchar*)(q + 8 * nb) + 128 * b + 64);
        if (64 * b < 16 * nb) {
            __builtin_prefetch((const __global uchar*)(d + 8 * nb) + 64 * b);
            __builtin_prefetch((const __global uchar*)(m + 8 * nb) + 64 * b);
        }
        uint8v w[4];
        tile_words(q, nb, b, w);
        v16si lo[4], hi[4];
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const ushort32 z = CVT(__builtin_astype(w[g], uchar32), ushort32);
            lo[g] = __builtin_astype(z & (ushort)0x0F, v16si);
            hi[g] = __builtin_astype(z >> (ushort)4, v16si);
        }
#pragma unroll
        for (int i = 0; i < tn; i++) {   // row i: values [K] int16, then dx [K/32], sx [K/32]
            const __global ulong* xb = (const __global ulong*)(x0 + i * TRB) + 8 * b;
            const __global float* dx = (const __global float*)(x0 + i * TRB + 2 * TK);
            v16si s = DOT_W16(__builtin_astype((int16)0, v16si), lo[0], __builtin_astype((ulong8)xb[0], v16si));
#pragma unroll
            for (int g = 1; g < 4; g++)
                s = DOT_W16(s, lo[g], __builtin_astype((ulong8)xb[g], v16si));
#pragma unroll
            for (int g = 0; g < 4; g++)
                s = DOT_W16(s, hi[g], __builtin_astype((ulong8)xb[4 + g], v16si));
            acc[i] = FMAV(CVT(__builtin_astype(s, int16), float16), dw * dx[b],
                          FMAV(mw, (float16)dx[nb + b], acc[i]));
        }
    }
#pragma unroll
    for (int i = 0; i < tn; i++) {
        if (n0 + i < N)
            tile_store(arena, out_o, ld, rows_o, kv, n0 + i, r0, acc[i].even + acc[i].odd);
    }
#else
    float8 acc[TILE_MAX];
    for (int i = 0; i < tn; i++) acc[i] = 0.0f;
    for (int b = 0; b < nb; b++) {
        float dws[8], mws[8];
        int sums[TILE_MAX][8];
        for (int j = 0; j < 8; j++) {
            dws[j] = HALF(d, j * nb + b);
            mws[j] = HALF(m, j * nb + b);
            const uchar16 wq = as_uchar16(q[j * nb + b]);
            const int16 wl = convert_int16(wq & (uchar)0x0F), wh = convert_int16(wq >> (uchar)4);
            for (int i = 0; i < tn; i++) {
                const __global short16* x = (const __global short16*)(x0 + i * TRB) + 2 * b;
                const int16 p = wl * convert_int16(x[0]) + wh * convert_int16(x[1]);
                const int8 s8 = p.lo + p.hi;
                const int4 s4 = s8.lo + s8.hi;
                sums[i][j] = s4.x + s4.y + s4.z + s4.w;
            }
        }
        const float8 dw = vload8(0, dws), mw = vload8(0, mws);
        for (int i = 0; i < tn; i++) {
            const __global float* dx = (const __global float*)(x0 + i * TRB + 2 * TK);
            acc[i] += convert_float8(vload8(0, sums[i])) * (dw * dx[b]) + mw * dx[nb + b];
        }
    }
    for (int i = 0; i < tn; i++)
        if (n0 + i < N)
            tile_store(arena, out_o, ld, rows_o, kv, n0 + i, r0, acc[i]);
#endif
}
#endif

// linear_tile_n<tn>: N prepared int8 / int16 rows (prep_rows), W Q4_1 [M, K] (M a multiple of 8)
// -> out [N, M] in rows ld wide (row n at KV row rows[n] if rows_o != 0: paged KV), tile_rows
// above, tn rows a work-item. global (M / 8 rounded up to LIN_R, ceil(N / tn)), local (LIN_R, 1).
// linear_tile16_n<tn> (int8 builds on x86 with AVX512-VNNI and AVX512BW only): 16 weight rows a
// work-item (tile_rows16; M a multiple of 16), global (M / 16 rounded up to LIN_R, ceil(N / tn)).
// Built for one K only (TILE_K) and only in CLKernels._linear_tile's builds (TILE_ALL_N: not
// MoE's, which define TILE_K too), for each tn of TILE_NS (gpu/kernels.py).
#if (ACT_BITS == 8 || ACT_BITS == 16) && defined(TILE_K) && defined(TILE_ALL_N)
#define LINEAR_TILE(name, tile, w, tn) \
__kernel void name(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o, ulong out_o, \
                   int K, int M, int N, int ld, ulong rows_o, int row_bytes) \
{ \
    const int r0 = (w) * get_global_id(0), n0 = get_global_id(1) * (tn); \
    if (r0 >= M) return; \
    tile(arena, s_o, qs_o, d_o, m_o, out_o, K, N, ld, rows_o, rows_o != 0, row_bytes, r0, n0, tn); \
}
#ifdef VNNI512
#define LINEAR_TILES(tn) LINEAR_TILE(linear_tile_n##tn, tile_rows, 8, tn) \
                         LINEAR_TILE(linear_tile16_n##tn, tile_rows16, 16, tn)
#else
#define LINEAR_TILES(tn) LINEAR_TILE(linear_tile_n##tn, tile_rows, 8, tn)
#endif
LINEAR_TILES(1) LINEAR_TILES(2) LINEAR_TILES(3) LINEAR_TILES(4) LINEAR_TILES(5)
LINEAR_TILES(6) LINEAR_TILES(7) LINEAR_TILES(8) LINEAR_TILES(12) LINEAR_TILES(16)
#endif

#if (ACT_BITS == 16 || ACT_BITS == 8) && defined(Q8_X86) && defined(TILE_K) && defined(TILE_ALL_N)
// lm_head_tile_n<tn> (q16, q8): every row's logits from its prepared row in its own order
// (prep_rows_nat: int16, or int8 at q8), table Q8_0 [V, TILE_K] (codes [V, K] from qs_o, f16
// scales [V, K/32] from d_o) -> out [N, V]. lm_head_act's products (decode.cl block_dot_q8_0: a
// block's integer sum, times d_w dx), 8 table rows a work-item against tn rows, as tile_rows takes
// a Q4_1 tile: each block's 8 x 32 codes transposed (tile_words, twice: a Q8_0 block is two uint4
// a row) and widened to int16 once for the tn rows, then 8 vpdpwssd a block and row (dword g of
// the 8 rows against the row's qword g, 4 int16, broadcast: lane 2j+h sums row j's elements
// 4g+2h, 4g+2h+1). At q8 a row's block is widened to int16 first (the same integer sums).
// V a multiple of 8.  global (V / 8 rounded up to LIN_R, ceil(N / tn)), local (LIN_R, 1)
typedef short short32v __attribute__((ext_vector_type(32)));
TILE_INLINE void lm_tile_rows(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong out_o,
                              int N, int V, int r0, int n0, const int tn)
{
    const int nb = TK / QK;
    const __global uint4* q = AT(const uint4, qs_o) + (size_t)r0 * 2 * nb;   // row j, half c of block b: q[2 j nb + 2 b + c]
    const __global ushort* d = AT(const ushort, d_o) + (size_t)r0 * nb;
    const __global uchar* x0 = AT(const uchar, s_o + (ulong)n0 * TRB);      // row i at x0 + i TRB
    float16 acc[TILE_MAX];
#pragma unroll
    for (int i = 0; i < tn; i++) acc[i] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const float8 dw8 = tile_scales(d, nb, b);
        const float16 dw = __builtin_shufflevector(dw8, dw8, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        // the next tile's codes (16 nb lines) 4 lines a block, its scales (nb / 4 lines) a line a block
#pragma unroll
        for (int l = 0; l < 4; l++)
            __builtin_prefetch((const __global uchar*)(q + 16 * nb) + 256 * b + 64 * l);
        if (64 * b < 16 * nb)
            __builtin_prefetch((const __global uchar*)(d + 8 * nb) + 64 * b);
        v16si w16[8];
#pragma unroll
        for (int c = 0; c < 2; c++) {
            uint8v w[4];
            tile_words(q, 2 * nb, 2 * b + c, w);
#pragma unroll
            for (int g = 0; g < 4; g++)
                w16[4 * c + g] = __builtin_astype(CVT(__builtin_astype(w[g], char32), short32v), v16si);
        }
#pragma unroll
        for (int i = 0; i < tn; i++) {   // row i: values [K] in their own order, then dx [K/32]
            const __global float* dx = (const __global float*)(x0 + i * TRB + ACT_BYTES * TK);
#if ACT_BITS == 16
            const __global ulong* xb = (const __global ulong*)(x0 + i * TRB) + 8 * b;
#define XQ(k) __builtin_astype((ulong8)xb[k], v16si)
#else
            // widened once, through memory: each qword is then broadcast from it (one load
            // each), where a broadcast from a register's upper lanes takes shuffles
            volatile ulong8 xw = __builtin_astype(CVT(*(const __global char32*)(x0 + i * TRB + QK * b), short32v), ulong8);
            const volatile ulong* xs = (const volatile ulong*)&xw;
#define XQ(k) __builtin_astype((ulong8)xs[k], v16si)
#endif
            v16si s = DOT_W16(__builtin_astype((int16)0, v16si), w16[0], XQ(0));
#pragma unroll
            for (int k = 1; k < 8; k++)
                s = DOT_W16(s, w16[k], XQ(k));
#undef XQ
            acc[i] = FMAV(CVT(__builtin_astype(s, int16), float16), dw * dx[b], acc[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < tn; i++)
        if (n0 + i < N)
            vstore8(acc[i].even + acc[i].odd, 0, AT(float, out_o) + (size_t)(n0 + i) * V + r0);
}
#define LM_TILE(tn) \
__kernel void lm_head_tile_n##tn(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong out_o, \
                                 int N, int V) \
{ \
    const int r0 = 8 * get_global_id(0), n0 = get_global_id(1) * (tn); \
    if (r0 >= V) return; \
    lm_tile_rows(arena, s_o, qs_o, d_o, out_o, N, V, r0, n0, tn); \
}
LM_TILE(1) LM_TILE(2) LM_TILE(3) LM_TILE(4) LM_TILE(5) LM_TILE(6) LM_TILE(7) LM_TILE(8)
LM_TILE(12) LM_TILE(16)
#endif
