// socllm's OpenCL kernels: the 8 ops of actors/kernels_numpy.py (their specification), op for op.
//
// Every tensor lives in ONE buffer, the pool's arena, addressed by byte offsets (64-byte aligned):
// f32 activations / KV rows, Q4_1 and Q8_0 weights in the planar layout of models/quant.py.
// Weights stay quantized in memory (W4A16): blocks are dequantized in registers, sums are f32.
// Work-item mapping is tuned for PoCL on a CPU (one work-item = one output row, explicit float8 /
// float16 vectors inside it); LIN_T > 1 splits a GEMV row over LIN_T work-items for a real GPU.

#define QK 32

#ifndef LIN_T        // work-items sharing one GEMV row (reduction in local memory when > 1)
#define LIN_T 1
#endif
#ifndef LIN_R        // GEMV rows per work-group
#define LIN_R 16
#endif
#ifndef GEMM_TN      // tokens per GEMM work-item: each dequantized block is reused GEMM_TN times
#define GEMM_TN 8
#endif
#ifndef HEAD_DIM     // attention head size, a multiple of 16 (CLKernels rebuilds for another)
#define HEAD_DIM 64
#endif
#define HC (HEAD_DIM / 16)

#define F32(off) ((__global float*)(arena + (off)))
#define HALF(off) ((__global const half*)(arena + (off)))

inline float hsum8(float8 v) { float4 a = v.lo + v.hi; float2 b = a.lo + a.hi; return b.x + b.y; }
inline float hsum16(float16 v) { return hsum8(v.lo + v.hi); }

// One Q4_1 block: 16 bytes of sequential nibbles (byte i = q[2i] | q[2i+1] << 4)
// -> weights 0..15 (*a) and 16..31 (*b), dequantized: w = d * q + m.
inline void q4_block(const __global uchar* p, float d, float m, float16* a, float16* b)
{
    const uchar16 v = vload16(0, p);
    const uchar16 lo = v & (uchar)0x0F, hi = v >> (uchar)4;
    const uchar16 ia = shuffle2(lo, hi, (uchar16)(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
    const uchar16 ib = shuffle2(lo, hi, (uchar16)(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
    *a = fma(convert_float16(ia), (float16)d, (float16)m);
    *b = fma(convert_float16(ib), (float16)d, (float16)m);
}

// embed: ids int32 [N], table Q8_0 [V, D] -> out [N, D].  global (D, N)
__kernel void embed(__global uchar* arena, ulong ids_o, ulong qs_o, ulong d_o, ulong out_o, int D)
{
    const int j = get_global_id(0), n = get_global_id(1);
    if (j >= D) return;
    const int id = ((__global const int*)(arena + ids_o))[n];
    const size_t row = (size_t)id * D;
    const float q = (float)((__global const char*)(arena + qs_o))[row + j];
    F32(out_o)[(size_t)n * D + j] = q * vload_half(row / QK + j / QK, HALF(d_o));
}

// rmsnorm: x [N, D], w [D] -> out [N, D] = x / sqrt(mean(x^2) + eps) * w.  global (N)
__kernel void rmsnorm(__global uchar* arena, ulong x_o, ulong w_o, ulong out_o, int D, float eps, int N)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    const __global float* x = F32(x_o) + (size_t)n * D;
    const __global float* w = F32(w_o);
    __global float* out = F32(out_o) + (size_t)n * D;
    float16 acc = 0.0f;
    int j = 0;
    for (; j + 16 <= D; j += 16) { const float16 v = vload16(0, x + j); acc = fma(v, v, acc); }
    float ss = hsum16(acc);
    for (; j < D; j++) ss = fma(x[j], x[j], ss);
    const float r = 1.0f / sqrt(ss / (float)D + eps);
    for (j = 0; j + 16 <= D; j += 16) vstore16(vload16(0, x + j) * r * vload16(0, w + j), 0, out + j);
    for (; j < D; j++) out[j] = x[j] * r * w[j];
}

// linear, decode (N == 1): x [1, K], W Q4_1 [M, K] -> out [1, M] = x @ W.T.
// global (LIN_T, M rounded up to LIN_R), local (LIN_T, LIN_R): LIN_T work-items per row.
__kernel void linear_gemv(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong m_o,
                          ulong out_o, int K, int M)
{
    const int t = get_local_id(0), r = get_global_id(1);
    const int nb = K / QK, rr = min(r, M - 1);   // clamped: every work-item reaches the barrier
    const __global uchar* q = arena + qs_o + (size_t)rr * (K / 2);
    const __global half* d = HALF(d_o) + (size_t)rr * nb;
    const __global half* m = HALF(m_o) + (size_t)rr * nb;
    const __global float* x = F32(x_o);
    float16 acc = 0.0f;
    for (int b = t; b < nb; b += LIN_T) {
        float16 wa, wb;
        q4_block(q + b * (QK / 2), vload_half(b, d), vload_half(b, m), &wa, &wb);
        acc = fma(wa, vload16(0, x + b * QK), acc);
        acc = fma(wb, vload16(1, x + b * QK), acc);
    }
    float s = hsum16(acc);
#if LIN_T > 1
    __local float part[LIN_R][LIN_T];
    const int lr = get_local_id(1);
    part[lr][t] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int w = LIN_T / 2; w > 0; w /= 2) {     // LIN_T is a power of two
        if (t < w) part[lr][t] += part[lr][t + w];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    s = part[lr][0];
#endif
    if (t == 0 && r < M) F32(out_o)[r] = s;
}

// linear, prefill (N > 1): x [N, K], W Q4_1 [M, K] -> out [N, M].
// global (M rounded up, ceil(N / GEMM_TN)): one work-item = one row of W x GEMM_TN tokens.
__kernel void linear_gemm(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong m_o,
                          ulong out_o, int K, int M, int N)
{
    const int r = get_global_id(0), n0 = get_global_id(1) * GEMM_TN;
    if (r >= M) return;
    const int nb = K / QK;
    const __global uchar* q = arena + qs_o + (size_t)r * (K / 2);
    const __global half* d = HALF(d_o) + (size_t)r * nb;
    const __global half* m = HALF(m_o) + (size_t)r * nb;
    const __global float* x[GEMM_TN];
    float8 acc[GEMM_TN];
#pragma unroll
    for (int i = 0; i < GEMM_TN; i++) {   // tail tokens repeat row N-1; they are not stored
        x[i] = F32(x_o) + (size_t)min(n0 + i, N - 1) * K;
        acc[i] = 0.0f;
    }
    for (int b = 0; b < nb; b++) {
        float16 wa, wb;
        q4_block(q + b * (QK / 2), vload_half(b, d), vload_half(b, m), &wa, &wb);
#pragma unroll
        for (int i = 0; i < GEMM_TN; i++) {
            const __global float* xb = x[i] + b * QK;
            float8 a = fma(wa.lo, vload8(0, xb), acc[i]);
            a = fma(wa.hi, vload8(1, xb), a);
            a = fma(wb.lo, vload8(2, xb), a);
            acc[i] = fma(wb.hi, vload8(3, xb), a);
        }
    }
#pragma unroll
    for (int i = 0; i < GEMM_TN; i++)
        if (n0 + i < N) F32(out_o)[(size_t)(n0 + i) * M + r] = hsum8(acc[i]);
}

// rope (GGML NORM): x [N, H*hd] -> out [N, H*hd] (out may be a KV row range; in place is fine):
// pair (2i, 2i+1) rotated by (pos0 + n) * theta^(-2i/hd).  global (H*hd/2, N)
__kernel void rope(__global uchar* arena, ulong x_o, ulong out_o, int H, int hd, float theta, int pos0)
{
    const int p = get_global_id(0), n = get_global_id(1), half_hd = hd / 2;
    if (p >= H * half_hd) return;
    const int i = p % half_hd;
    const float inv = pow(theta, -(float)(2 * i) / (float)hd);
    const float ang = (float)(pos0 + n) * inv;
    const float c = cos(ang), s = sin(ang);
    const float2 v = vload2(p, F32(x_o) + (size_t)n * H * hd);
    vstore2((float2)(v.x * c - v.y * s, v.x * s + v.y * c), p, F32(out_o) + (size_t)n * H * hd);
}

// attention: q [N, H*hd], K/V cache [pos0+N, KVH*hd] -> out [N, H*hd]; causal (row n sees keys
// 0 .. pos0+n), GQA (head h reads kv head h / (H/KVH)), online softmax in f32.  global (H, N)
__kernel void attention(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong out_o,
                        int H, int KVH, int pos0)
{
    const int h = get_global_id(0), n = get_global_id(1);
    if (h >= H) return;
    const int kv = h / (H / KVH), kw = KVH * HEAD_DIM;
    const __global float* q = F32(q_o) + ((size_t)n * H + h) * HEAD_DIM;
    const __global float* k = F32(k_o) + kv * HEAD_DIM;
    const __global float* v = F32(v_o) + kv * HEAD_DIM;
    const float sq = sqrt((float)HEAD_DIM);
    float16 qv[HC], acc[HC];
#pragma unroll
    for (int c = 0; c < HC; c++) { qv[c] = vload16(c, q); acc[c] = 0.0f; }
    float mx = -INFINITY, sum = 0.0f;
    const int last = pos0 + n;
    for (int l = 0; l <= last; l++) {
        const __global float* kl = k + (size_t)l * kw;
        float16 t = qv[0] * vload16(0, kl);
#pragma unroll
        for (int c = 1; c < HC; c++) t = fma(qv[c], vload16(c, kl), t);
        const float s = hsum16(t) / sq;
        if (s > mx) {                       // new running max: rescale what is summed so far
            const float a = exp(mx - s);
            sum *= a;
#pragma unroll
            for (int c = 0; c < HC; c++) acc[c] *= a;
            mx = s;
        }
        const float p = exp(s - mx);
        sum += p;
        const __global float* vl = v + (size_t)l * kw;
#pragma unroll
        for (int c = 0; c < HC; c++) acc[c] = fma((float16)p, vload16(c, vl), acc[c]);
    }
    __global float* out = F32(out_o) + ((size_t)n * H + h) * HEAD_DIM;
    const float inv = 1.0f / sum;
#pragma unroll
    for (int c = 0; c < HC; c++) vstore16(acc[c] * inv, c, out);
}

// silu_mul: g, u [count] -> out = silu(g) * u.  global (count rounded up)
__kernel void silu_mul(__global uchar* arena, ulong g_o, ulong u_o, ulong out_o, int count)
{
    const int i = get_global_id(0);
    if (i >= count) return;
    const float g = F32(g_o)[i];
    F32(out_o)[i] = g / (1.0f + exp(-g)) * F32(u_o)[i];
}

// add: a, b [count] -> out = a + b.  global (count rounded up)
__kernel void add(__global uchar* arena, ulong a_o, ulong b_o, ulong out_o, int count)
{
    const int i = get_global_id(0);
    if (i >= count) return;
    F32(out_o)[i] = F32(a_o)[i] + F32(b_o)[i];
}

// lm_head: x [N, D] (row N-1 used), table Q8_0 [V, D] -> out [V].  global (V rounded up)
__kernel void lm_head(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong out_o,
                      int D, int V, int N)
{
    const int r = get_global_id(0);
    if (r >= V) return;
    const int nb = D / QK;
    const __global float* x = F32(x_o) + (size_t)(N - 1) * D;
    const __global char* q = (__global const char*)(arena + qs_o) + (size_t)r * D;
    const __global half* d = HALF(d_o) + (size_t)r * nb;
    float16 acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        float16 t = convert_float16(vload16(0, q + b * QK)) * vload16(0, x + b * QK);
        t = fma(convert_float16(vload16(1, q + b * QK)), vload16(1, x + b * QK), t);
        acc = fma(t, (float16)vload_half(b, d), acc);
    }
    F32(out_o)[r] = hsum16(acc);
}
