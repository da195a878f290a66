// socllm's decode epilogues and split-K attention (N == 1), built after kernels.cl and decode.cl
// (they use those files' helpers: att_step8, prep_block, dot2, norm_prep_row's pieces).

// ---- decode attention, split-K with GQA sharing ("flash-decoding") ----------------------------
// attention_split: q [H*hd], K/V cache rows 0 .. pos0 -> partials at p_o, per (head h, split s):
// [max, sum, acc[hd]] of an online softmax over keys lo + s*chunk .. lo + (s+1)*chunk - 1 (chunk:
// the row's keys over ATT_S splits, in 8-key steps; lo: 0, or a sliding window's first key
// rounded down to 8). A work-item takes every head over its keys: the K/V
// rows of its chunk ([chunk, KVH*hd], contiguous) stream in once and stay in cache for all the
// heads (GQA: H/KVH query heads read each KV head), and ATT_S work-groups keep the threads busy
// where H work-groups (9 here) did not. Measured 10-20 % faster than one work-item per (head)
// at 512-1024 keys; the cache is read at ~10 GB/s, still far from the device's ~30.
// global (ATT_S), local (1)
#ifndef ATT_S
#define ATT_S 16
#endif
#define PART (HEAD_DIM + 2)     // floats of one partial

inline void attention_part(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong p_o,
                           int H, int KVH, int pos0, ulong seq_o, ulong btab_o, int BR, int MB,
                           int win)
{
    // paged KV (btab_o != 0, paged.cl): key l of sequence seq[0] is KV row bt[l / BR] * BR + l % BR
    const __global int* bt = btab_o ? AT(const int, btab_o) + (size_t)AT(const int, seq_o)[0] * MB : 0;
    const int s = get_global_id(0), grp = H / KVH, kw = KVH * HC;
    const int L = pos0 + 1, lo = win_start(L, win), lo8 = lo & ~7;
    const int chunk = ((L - lo8 + ATT_S - 1) / ATT_S + 7) / 8 * 8;
    const int l0 = lo8 + s * chunk, l1 = min(L, l0 + chunk);
    const float rsq = 1.0f / sqrt((float)HEAD_DIM);
    for (int h = 0; h < H; h++) {          // head-major: the chunk's K/V rows stay in cache
        const int kv = h / grp;
        const __global kv8* k = AT(const kv8, k_o) + kv * HC;
        const __global kv8* v = AT(const kv8, v_o) + kv * HC;
        const __global float8* q = AT(const float8, q_o) + h * HC;
        float8 acc[HC];
#pragma unroll
        for (int c = 0; c < HC; c++) acc[c] = 0.0f;
        float mx = -INFINITY, sum = 0.0f;
        for (int l = l0; l < l1; l += 8) {
            const long shift = bt ? (long)(bt[l / BR] * BR + l % BR - l) * kw : 0;
            att_step8(q, k + shift, v + shift, kw, l, lo, l1, rsq, &mx, &sum, acc);
        }
        __global float* p = AT(float, p_o) + (size_t)(h * ATT_S + s) * PART;
        p[0] = mx, p[1] = sum;
#pragma unroll
        for (int c = 0; c < HC; c++) {
            const float8 a = acc[c];
            p[2 + 8 * c] = a.s0, p[3 + 8 * c] = a.s1, p[4 + 8 * c] = a.s2, p[5 + 8 * c] = a.s3;
            p[6 + 8 * c] = a.s4, p[7 + 8 * c] = a.s5, p[8 + 8 * c] = a.s6, p[9 + 8 * c] = a.s7;
        }
    }
}

__kernel void attention_split(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong p_o,
                              int H, int KVH, int pos0, ulong seq_o, ulong btab_o, int BR, int MB,
                              int win)
{
    attention_part(arena, q_o, k_o, v_o, p_o, H, KVH, pos0, seq_o, btab_o, BR, MB, win);
}

// merge_prep: partials -> out [H*hd] = sum_s e^(mx_s - M) acc_s / sum_s e^(mx_s - M) sum_s
// (M: the head's max; split 0 always holds key 0, so M is finite and an empty split weighs 0),
// prepared for the o projection, and stored at out_o when store != 0.  global (1)
inline void merge_prep_row(__global uchar* arena, ulong p_o, ulong s_o, ulong out_o, int H, int store)
{
    const int D = H * HEAD_DIM;
    for (int h = 0; h < H; h++) {
        const __global float* p = AT(const float, p_o) + (size_t)h * ATT_S * PART;
        float M = p[0];
        for (int s = 1; s < ATT_S; s++) M = p[s * PART] > M ? p[s * PART] : M;
        float z = 0.0f, w[ATT_S];
        for (int s = 0; s < ATT_S; s++) {
            w[s] = exp_f32(p[s * PART] - M);
            z += w[s] * p[s * PART + 1];
        }
        for (int b = 0; b < HEAD_DIM / QK; b++) {
            float8 y[4];
            for (int c = 0; c < 4; c++) {
                float8 o = 0.0f;
                for (int s = 0; s < ATT_S; s++) {
                    const __global float* a = p + s * PART + 2 + (b * 4 + c) * 8;
                    o += (float8)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]) * w[s];
                }
                y[c] = o / z;
            }
            const int blk = h * (HEAD_DIM / QK) + b;
            prep_block(y[0], y[1], y[2], y[3], arena, s_o, D, blk, 0);
            if (store) {
                __global float8* out = AT(float8, out_o) + 4 * blk;
                out[0] = y[0], out[1] = y[1], out[2] = y[2], out[3] = y[3];
            }
        }
    }
}

__kernel void merge_prep(__global uchar* arena, ulong p_o, ulong s_o, ulong out_o, int H, int store)
{
    merge_prep_row(arena, p_o, s_o, out_o, H, store);
}

// ---- epilogues in the launch's last work-group ------------------------------------------------
// A norm, a prep or attention's merge needs the whole output row, which every work-group of the
// launch writes a part of. Instead of a launch of its own (~3-4 us on PoCL), it runs in the
// work-group that finishes last: each group counts itself done on an atomic word at c_o, and the
// one that sees the count complete resets it and runs the epilogue. The rows of the others are
// visible to it: their stores come before their atomic increment (mem_fence; x86 orders stores).
// Every work-item reaches the barrier: the kernels below have no early return.
inline int last_group(__global uchar* arena, ulong c_o)
{
    barrier(CLK_GLOBAL_MEM_FENCE);
    int last = 0;
    if (get_local_id(0) == 0 && get_local_id(1) == 0) {
        mem_fence(CLK_GLOBAL_MEM_FENCE);
        const int groups = (int)(get_num_groups(0) * get_num_groups(1));
        last = atomic_inc(AT(volatile int, c_o)) == groups - 1;
        if (last) {
            mem_fence(CLK_GLOBAL_MEM_FENCE);
            *AT(volatile int, c_o) = 0;
        }
    }
    return last;
}

#if LIN_T > 1
// a GPU: every work-item fences its own stores before the group counts itself done (more than
// one work-item of a group writes the row), and the whole group runs the epilogue
inline int last_group_all(__global uchar* arena, ulong c_o, __local int* flag)
{
    mem_fence(CLK_GLOBAL_MEM_FENCE);
    barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
    if (get_local_id(0) == 0 && get_local_id(1) == 0) {
        const int groups = (int)(get_num_groups(0) * get_num_groups(1));
        const int last = atomic_inc(AT(volatile int, c_o)) == groups - 1;
        if (last) {
            mem_fence(CLK_GLOBAL_MEM_FENCE);    // the others' rows after their count (acquire)
            *AT(volatile int, c_o) = 0;
        }
        *flag = last;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    return *flag;
}
#define LID ((int)(get_local_id(1) * get_local_size(0) + get_local_id(0)))
#define GROUP_N ((int)(get_local_size(0) * get_local_size(1)))
#endif

#ifndef W_FLT
// linear_act_norm: linear_act, then norm_prep of its output [M] (D = M) by the last group.
// ROW_PAIR's geometry
__kernel void linear_act_norm(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o,
                              ulong out_o, ulong res_o, int K, int M, int add, ulong w_o,
                              ulong norm_o, float eps, int store, int natural, ulong c_o)
{
    ROW_PAIR(M);
    float2 y = PAIR_DOT(qs_o, d_o, m_o, K);
    if (mine) {
        if (add) y += (float2)(AT(const float, res_o)[r0], AT(const float, res_o)[r1]);
        AT(float, out_o)[r0] = y.x;
        if (r0 + 1 < M) AT(float, out_o)[r0 + 1] = y.y;
    }
#if LIN_T > 1
    __local int flag;
    __local float part[LIN_T * LIN_R];
    if (last_group_all(arena, c_o, &flag))
        norm_prep_group(arena, (const volatile __global float*)AT(const float, out_o), w_o, s_o,
                        norm_o, M, eps, store, natural, LID, GROUP_N, part);
#else
    if (last_group(arena, c_o)) norm_prep_row(arena, out_o, w_o, s_o, norm_o, M, eps, store, natural);
#endif
}
#endif

#ifndef W_FLT
// gate_up_silu_prep: gate_up_silu, then prep of its output [M] (K = M) by the last group.
// ROW_PAIR's geometry
__kernel void gate_up_silu_prep(__global uchar* arena, ulong s_o, ulong g_qs, ulong g_d, ulong g_m,
                                ulong u_qs, ulong u_d, ulong u_m, ulong out_o, int K, int M,
                                ulong c_o)
{
    ROW_PAIR(M);
    const float2 g = PAIR_DOT(g_qs, g_d, g_m, K);
    const float2 u = PAIR_DOT(u_qs, u_d, u_m, K);
    if (mine) {
        AT(float, out_o)[r0] = g.x / (1.0f + exp_f32(-g.x)) * u.x;
        if (r0 + 1 < M) AT(float, out_o)[r0 + 1] = g.y / (1.0f + exp_f32(-g.y)) * u.y;
    }
#if LIN_T > 1
    __local int flag;
    if (last_group_all(arena, c_o, &flag))
        prep_group(arena, (const volatile __global float*)AT(const float, out_o), s_o, M, LID, GROUP_N);
#else
    if (last_group(arena, c_o)) {
        const __global float8* x = AT(const float8, out_o);
        for (int b = 0; b < M / QK; b++)
            prep_block(x[4 * b], x[4 * b + 1], x[4 * b + 2], x[4 * b + 3], arena, s_o, M, b, 0);
    }
#endif
}
#endif

#if ATT_WG > 1 && LIN_T > 1
// attention_merge on a GPU: a work-group per head, split-K over its ATT_WG work-items merged in
// local memory (kernels.cl attention's scheme); the row goes to out (store) or else to the
// partials' scratch p_o, and the last group prepares it.  global (ATT_WG, H), local (ATT_WG, 1)
__kernel void attention_merge(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong p_o,
                              int H, int KVH, int pos_arg, ulong s_o, ulong out_o, int store, ulong c_o,
                              ulong seq_o, ulong btab_o, int BR, int MB, int win, ulong pw_o)
{
    const int pos0 = pw_o ? AT(const int, pw_o)[0] : pos_arg;    // rope_table's pw_o
    // paged KV (btab_o != 0, paged.cl): key l of sequence seq[0] is KV row bt[l / BR] * BR + l % BR
    const __global int* bt = btab_o ? AT(const int, btab_o) + (size_t)AT(const int, seq_o)[0] * MB : 0;
    const int t = get_local_id(0), h = get_global_id(1);
    const int kv = h / (H / KVH), kw = KVH * HC;
    const __global float8* q = AT(const float8, q_o) + h * HC;
    const __global kv8* k = AT(const kv8, k_o) + kv * HC;
    const __global kv8* v = AT(const kv8, v_o) + kv * HC;
    const float rsq = 1.0f / sqrt((float)HEAD_DIM);
    const int L = pos0 + 1, lo = win_start(L, win);
    float8 acc[HC];
#pragma unroll
    for (int c = 0; c < HC; c++) acc[c] = 0.0f;
    float mx = -INFINITY, sum = 0.0f;
    for (int l = (lo & ~7) + 8 * t; l < L; l += 8 * ATT_WG) {
        const long shift = bt ? (long)(bt[l / BR] * BR + l % BR - l) * kw : 0;
        att_step8(q, k + shift, v + shift, kw, l, lo, L, rsq, &mx, &sum, acc);
    }
    __local float part_mx[ATT_WG], part_sum[ATT_WG];
    __local float8 part_acc[ATT_WG * HC];
    const ulong row = store ? out_o : p_o;
    att_store(AT(float8, row) + h * HC, t, mx, sum, acc, part_mx, part_sum, part_acc);
    __local int flag;
    if (last_group_all(arena, c_o, &flag))
        prep_group(arena, (const volatile __global float*)AT(const float, row), s_o, H * HEAD_DIM,
                   LID, GROUP_N);
}
#else
// attention_merge: attention_split, then merge_prep by the last group
__kernel void attention_merge(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong p_o,
                              int H, int KVH, int pos_arg, ulong s_o, ulong out_o, int store, ulong c_o,
                              ulong seq_o, ulong btab_o, int BR, int MB, int win, ulong pw_o)
{
    const int pos0 = pw_o ? AT(const int, pw_o)[0] : pos_arg;    // rope_table's pw_o
    attention_part(arena, q_o, k_o, v_o, p_o, H, KVH, pos0, seq_o, btab_o, BR, MB, win);
    if (last_group(arena, c_o)) merge_prep_row(arena, p_o, s_o, out_o, H, store);
}
#endif
