// ---- mixture of experts (graph/build.py _moe; NPUMoE) -----------------------------------------

// moe_route: router logits x [N, E], sal [N, D] -> out [N, 2k+1]: each row's k experts, the most
// probable first (ties: the lower id), as floats, their softmax weights, renormalized to sum 1
// when norm (clamped below at 2^-14, as llama.cpp's build_moe_ffn), and the L2 norm of its sal
// row. E <= 256. global (N): a row each.
__kernel void moe_route(__global uchar* arena, ulong x_o, ulong sal_o, ulong out_o, int E, int k,
                        int norm, int N, int D)
{
    const int n = get_global_id(0);
    if (n >= N) return;
    const __global float* z = AT(const float, x_o) + (size_t)n * E;
    const __global float* sal = AT(const float, sal_o) + (size_t)n * D;
    __global float* out = AT(float, out_o) + (size_t)n * (2 * k + 1);
    float ss = 0.0f;
    for (int i = 0; i < D; i++) ss += sal[i] * sal[i];
    out[2 * k] = sqrt(ss);
    float mx = z[0], sum = 0.0f, wsum = 0.0f;
    for (int e = 1; e < E; e++) mx = fmax(mx, z[e]);
    for (int e = 0; e < E; e++) sum += exp(z[e] - mx);
    uint taken[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = 0; j < k; j++) {          // selection: the largest logit not taken yet (by
                                           // logit, not probability: models/oracle.py route)
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!((taken[e >> 5] >> (e & 31)) & 1u) && (best < 0 || z[e] > z[best])) best = e;
        taken[best >> 5] |= 1u << (best & 31);
        const float p = exp(z[best] - mx) / sum;
        out[j] = (float)best;
        out[k + j] = p;
        wsum += p;
    }
    if (norm) {
        const float s = fmax(wsum, 6.103515625e-5f);
        for (int j = 0; j < k; j++) out[k + j] /= s;
    }
}

// moe_linear: x [N, K] (per_slot: [N, k, K], slot j's own input), route [N, 2k+1] (moe_route's),
// W [E*M, K] in the build's format (expert e: rows e*M ..) -> out [N, k, M], y[n, j] = x[n(, j)]
// @ W_{e[n, j]}.T; combine: out [N, M] = sum over j in rank order of w[n, j] * y[n, j].
// global (M, N): one work-item = one output row of every slot of one token.
__kernel void moe_linear(__global uchar* arena, ulong x_o, ulong route_o, ulong qs_o, ulong d_o,
                         ulong m_o, ulong out_o, int K, int M, int k, int per_slot, int combine)
{
    const int r = get_global_id(0), n = get_global_id(1);
    if (r >= M) return;
    const int nb = K / QK;
    const __global float* rt = AT(const float, route_o) + (size_t)n * (2 * k + 1);
    float total = 0.0f;
    for (int j = 0; j < k; j++) {
        const int e = (int)rt[j];
        W_ROW((size_t)e * M + r, nb);
        const __global float8* x = AT(const float8, x_o) +
            ((size_t)n * (per_slot ? k : 1) + (per_slot ? j : 0)) * (K / 8);
        float8 a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        for (int b = 0; b < nb; b++) {
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
        const float s = hsum8((a0 + a1) + (a2 + a3));
        if (combine)
            total = j ? total + rt[k + j] * s : rt[k + j] * s;
        else
            AT(float, out_o)[((size_t)n * k + j) * M + r] = s;
    }
    if (combine) AT(float, out_o)[(size_t)n * M + r] = total;
}

#ifndef W_FLT
// moe_linear_act: moe_linear over rows prepared by prep_rows (decode.cl's format: ACT_BITS), row_bytes
// apart from s_o: row n, or per_slot row n * k + j (slot j's own input). Each weight block is
// multiplied as the dense GEMVs do (dot2: d * sum(q x) + m * sum(x) per block; int16 / int8
// products at q16 / q8), two rows of an expert a work-item. out as moe_linear's; combine sums the
// slots in rank order. A decode step's few rows (CLKernels._moe_linear).
// global (LIN_T, ceil(M / 2) rounded up to LIN_R, N * k, or N when combine), local (LIN_T, LIN_R, 1)
#if LIN_T > 1
#define MOE_DOT_W(qs, d, m, e, act) dot2_t(arena, qs, d, m, (e) * M + ra_, (e) * M + r1, K, act, t, \
                                           part_[get_local_id(1)])
#else
#define MOE_DOT_W(qs, d, m, e, act) (mine ? dot2(arena, qs, d, m, (e) * M + r0, (e) * M + r1, K, act) \
                                          : (float2)0.0f)
#endif
#define MOE_DOT(e, act) MOE_DOT_W(qs_o, d_o, m_o, e, act)
// res_o != 0 (combine): out = res + the sum (the residual add after the FFN, as kernels.cl add)
__kernel void moe_linear_act(__global uchar* arena, ulong s_o, ulong route_o, ulong qs_o, ulong d_o,
                             ulong m_o, ulong out_o, int K, int M, int k, int per_slot, int combine,
                             int row_bytes, ulong res_o)
{
    ROW_PAIR(M);
    const int g = get_global_id(2), n = combine ? g : g / k;
    const __global float* rt = AT(const float, route_o) + (size_t)n * (2 * k + 1);
    __global float* out = AT(float, out_o);
    if (!combine) {
        const int j = g - n * k;
        const float2 y = MOE_DOT((int)rt[j], s_o + (ulong)(per_slot ? g : n) * row_bytes);
        if (!mine) return;
        out[(size_t)g * M + r0] = y.x;
        if (r0 + 1 < M) out[(size_t)g * M + r0 + 1] = y.y;
        return;
    }
    float2 total = 0.0f;
    for (int j = 0; j < k; j++) {
        const float2 y = MOE_DOT((int)rt[j], s_o + (ulong)(per_slot ? n * k + j : n) * row_bytes);
        total = j ? total + rt[k + j] * y : rt[k + j] * y;
    }
    if (!mine) return;
    const __global float* res = AT(const float, res_o) + (size_t)n * M;
    out[(size_t)n * M + r0] = res_o ? res[r0] + total.x : total.x;
    if (r0 + 1 < M) out[(size_t)n * M + r0 + 1] = res_o ? res[r0 + 1] + total.y : total.y;
}

// moe_gate_up: moe_linear_act of W_gate and W_up over the same prepared rows (row n of N), and the
// gated product (kernels.cl silu_mul, or gelu_mul when gelu): out [N, k, M] = act(W_gate_e x) *
// (W_up_e x), e = slot j's expert. The one-row decode's three launches as one (graph/fuse.py).
// global (LIN_T, ceil(M / 2) rounded up to LIN_R, N * k), local (LIN_T, LIN_R, 1)
inline float gated(float g, float u, int gelu)
{
    if (!gelu) return g / (1.0f + exp_f32(-g)) * u;
    const float t = tanh(0.7978845608f * (g + 0.044715f * g * g * g));
    return 0.5f * g * (1.0f + t) * u;
}
__kernel void moe_gate_up(__global uchar* arena, ulong s_o, ulong route_o, ulong g_qs, ulong g_d,
                          ulong g_m, ulong u_qs, ulong u_d, ulong u_m, ulong out_o, int K, int M,
                          int k, int gelu, int row_bytes)
{
    ROW_PAIR(M);
    const int g = get_global_id(2), n = g / k, j = g - n * k;
    const int e = (int)(AT(const float, route_o)[(size_t)n * (2 * k + 1) + j]);
    const ulong act = s_o + (ulong)n * row_bytes;
    const float2 gv = MOE_DOT_W(g_qs, g_d, g_m, e, act);
    const float2 uv = MOE_DOT_W(u_qs, u_d, u_m, e, act);
    if (!mine) return;
    __global float* out = AT(float, out_o) + (size_t)g * M;
    out[r0] = gated(gv.x, uv.x, gelu);
    if (r0 + 1 < M) out[r0 + 1] = gated(gv.y, uv.y, gelu);
}
#endif


#if W_Q4_1 && LIN_T == 1 && !defined(W_FLT)
// moe_down_q4: moe_linear_act's combine over per-slot rows, for Q4_1 weights on a CPU: a slot's row
// is only K / 32 blocks (3 at the MoEfied SmolLM2's K = 96), so the slots' blocks go into one
// float8 a row, each block's scale times the slot's weight, reduced once at the end (per-slot
// reductions and pointer set-up cost as much as the products): ~1.3x moe_linear_act's speed there.
// MOE_R rows a work-item (2 measured fastest: 4 and 8 ran 1.5x slower, register pressure).
// global (ceil(M / MOE_R) rounded up to LIN_R, N), local (LIN_R, 1)
#define MOE_R 2
__kernel void moe_down_q4(__global uchar* arena, ulong s_o, ulong route_o, ulong qs_o, ulong d_o,
                          ulong m_o, ulong out_o, int K, int M, int k, int row_bytes, ulong res_o)
{
    const int r0 = MOE_R * get_global_id(0), n = get_global_id(1);
    if (r0 >= M) return;
    const __global float* rt = AT(const float, route_o) + (size_t)n * (2 * k + 1);
    const int nb = K / QK;
    float8 acc[MOE_R];
    float sm[MOE_R];
    for (int i = 0; i < MOE_R; i++) acc[i] = 0.0f, sm[i] = 0.0f;
    const __global ushort* dd = AT(const ushort, d_o);
    const __global ushort* mm = AT(const ushort, m_o);
    for (int j = 0; j < k; j++) {
        const int e = (int)rt[j];
        const float w = rt[k + j];
        const ulong act = s_o + (ulong)(n * k + j) * row_bytes;
        const __global uchar* xv = AT(const uchar, act);
        const __global float* dx = AT(const float, act + (ulong)ACT_BYTES * K);
        const __global float* sx = dx + nb;
        const size_t base = ((size_t)e * M + r0) * nb;
        const __global uchar16* q = AT(const uchar16, qs_o) + base;
        for (int b = 0; b < nb; b++) {
            const float wdx = w * dx[b], wsx = w * sx[b];
#pragma unroll
            for (int i = 0; i < MOE_R; i++) {
                const int ri = r0 + i < M ? i : 0;
                acc[i] += block_dot(q[ri * nb + b], xv, b) * (HALF(dd, base + ri * nb + b) * wdx);
                sm[i] += HALF(mm, base + ri * nb + b) * wsx;
            }
        }
    }
    const __global float* res = AT(const float, res_o) + (size_t)n * M;
    __global float* out = AT(float, out_o) + (size_t)n * M;
    for (int i = 0; i < MOE_R && r0 + i < M; i++) {
        const float y = hsum8(acc[i]) + sm[i];
        out[r0 + i] = res_o ? res[r0 + i] + y : y;
    }
}
#endif

#if (ACT_BITS == 8 || ACT_BITS == 16) && !defined(W_FLT) && W_Q4_1
// A decode batch's MoE linears grouped by expert (q16 / q8, Q4_1 experts): the batch's (token,
// slot) pairs sorted by expert (moe_sort), each pair's input row prepared into its expert's run
// of scratch rows (moe_gather), then each expert's rows through cl/batch.cl's weight tiles
// against that expert's weights (moe_tile): an expert's weight tile is loaded once for up to
// TILE_N of its rows, where moe_linear_act reads it again for every token routed to it.
//
// The sort's table at meta_o (ints): count [E], base [E] (an expert's first row: runs padded to
// TILE_N rows), then dst [R] (a run row's pair: n * k + j; -1 for padding), R = N k + E (TILE_N - 1)

// moe_sort: route [N, 2k+1] -> the table.  global (1)
__kernel void moe_sort(__global uchar* arena, ulong route_o, ulong meta_o, int N, int k, int E)
{
    __global int* count = AT(int, meta_o);
    __global int* base = count + E;
    __global int* dst = base + E;
    const int R = N * k + E * (TILE_N - 1);
    for (int r = 0; r < R; r++) dst[r] = -1;
    int row = 0;
    for (int e = 0; e < E; e++) {
        int c = 0;
        for (int n = 0; n < N; n++) {
            const __global float* rt = AT(const float, route_o) + (size_t)n * (2 * k + 1);
            for (int j = 0; j < k; j++)
                if ((int)rt[j] == e) dst[row + c++] = n * k + j;
        }
        count[e] = c, base[e] = row;
        row += (c + TILE_N - 1) / TILE_N * TILE_N;
    }
}

// moe_gather: x [N, K] (per_slot: [N, k, K]) -> run row r prepared (prep_rows' format) at
// s_o + r row_bytes from the input of its pair (padding rows: untouched, never stored).
// global (K / 32 rounded up, R)
__kernel void moe_gather(__global uchar* arena, ulong x_o, ulong meta_o, ulong s_o, int K,
                         int row_bytes, int k, int E, int per_slot)
{
    const int b = get_global_id(0), r = get_global_id(1);
    const int g = AT(const int, meta_o)[2 * E + r];
    if (b >= K / QK || g < 0) return;
    const __global float8* x = AT(const float8, x_o) + (size_t)(per_slot ? g : g / k) * (K / 8) + 4 * b;
    prep_block(x[0], x[1], x[2], x[3], arena, s_o + (ulong)r * row_bytes, K, b, 0);
}

// moe_tile: each expert's run of rows times its weights W_e [M, K] (rows e M .. of W [E M, K]),
// cl/batch.cl tile_rows: out row n k + j (rows M wide) for each of the expert's pairs.
// global (M / 8 rounded up to LIN_R, ceil(N / TILE_N), E), local (LIN_R, 1, 1)
__kernel void moe_tile(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o,
                       ulong out_o, ulong meta_o, int K, int M, int E, int row_bytes)
{
    const int r0 = 8 * get_global_id(0), n0 = get_global_id(1) * TILE_N, e = get_global_id(2);
    const __global int* meta = AT(const int, meta_o);
    if (r0 >= M || n0 >= meta[e]) return;
    const ulong rows = (ulong)M * e * (TK / QK);                // blocks before expert e's rows
    tile_rows(arena, s_o + (ulong)meta[E + e] * TRB, qs_o + 16 * rows, d_o + 2 * rows,
              m_o + 2 * rows, out_o, K, meta[e], M, meta_o + 4 * (ulong)(2 * E + meta[E + e]), 0,
              row_bytes, r0, n0, TILE_N);
}
#endif

// moe_combine: y [N, k, M] (each slot's output), route [N, 2k+1] -> out [N, M] = (res +) the sum
// over j in rank order of w[n, j] * y[n, j]: moe_linear's combine, the same float operations.
// global (M rounded up, N)
__kernel void moe_combine(__global uchar* arena, ulong y_o, ulong route_o, ulong out_o, ulong res_o,
                          int M, int k)
{
    const int r = get_global_id(0), n = get_global_id(1);
    if (r >= M) return;
    const __global float* rt = AT(const float, route_o) + (size_t)n * (2 * k + 1);
    const __global float* y = AT(const float, y_o) + (size_t)n * k * M + r;
    float total = rt[k] * y[0];
    for (int j = 1; j < k; j++) total = total + rt[k + j] * y[(size_t)j * M];
    AT(float, out_o)[(size_t)n * M + r] = res_o ? AT(const float, res_o)[(size_t)n * M + r] + total : total;
}
