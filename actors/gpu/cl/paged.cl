// Paged KV and batched rows (memory/blocks.py): the ops of a serving step, whose N rows may
// belong to different sequences at their own positions. Per-row metadata is data in the pool,
// written by the runner before each step:
//   pos  int32 [N]            position of row n in its sequence
//   rows int32 [N]            the KV row (block * BR + pos % BR) where row n's K and V go (a
//                             draft tree's row: its own place past the sequence's length)
//   seq  int32 [N]            row n's sequence: its block table is btab[seq * MB ..]
//   btab int32 [seqs, MB]     block tables, MB blocks of BR rows each at most
//   tmask int32 [N, 4]        a decode step's draft tree rows: the keys they see (tree_row)
// Keys are read 8 at a time (att_step8); BR is a multiple of 8, so 8 keys never straddle blocks.

// rope of rows at their own positions: x [N, H*hd] -> out rows (KV rows rows[n] if rows_o != 0,
// else row n); t_o != 0: cos and sin from rope_rows_table's table, else computed here.
// global (hd/2, N)
__kernel void rope_rows(__global uchar* arena, ulong x_o, ulong out_o, ulong pos_o, ulong rows_o,
                        int H, int hd, float theta, ulong t_o, int neox, ulong f_o)
{
    const int i = get_global_id(0), n = get_global_id(1);
    float c, s;
    if (t_o) {
        c = AT(const float, t_o)[n * hd + i];
        s = AT(const float, t_o)[n * hd + hd / 2 + i];
    } else {
        const float ang = rope_angle((float)AT(const int, pos_o)[n], i, hd, theta, arena, f_o);
        c = cos(ang), s = sin(ang);
    }
    const int a = neox ? i : 2 * i, b = neox ? i + hd / 2 : 2 * i + 1;
    const __global float* x = AT(const float, x_o) + (size_t)n * H * hd;
    if (rows_o) {                           // K: KV row rows[n]
        __global kv_t* out = AT(kv_t, out_o) + (size_t)AT(const int, rows_o)[n] * H * hd;
        for (int h = 0; h < H; h++) {
            const float v0 = x[h * hd + a], v1 = x[h * hd + b];
            KV_PUT(out, h * hd + a, v0 * c - v1 * s);
            KV_PUT(out, h * hd + b, v0 * s + v1 * c);
        }
        return;
    }
    __global float* out = AT(float, out_o) + (size_t)n * H * hd;
    for (int h = 0; h < H; h++) {
        const float v0 = x[h * hd + a], v1 = x[h * hd + b];
        out[h * hd + a] = v0 * c - v1 * s;
        out[h * hd + b] = v0 * s + v1 * c;
    }
}

// rope_rows_table: per row n, cos [hd/2] then sin [hd/2] of its position at t_o + n hd floats:
// once a step, read by the step's 2 L rope_rows (pow, cos and sin are library calls here, ~4 ms
// a 16-row step when every rope computes them).  global (hd/2, N)
__kernel void rope_rows_table(__global uchar* arena, ulong pos_o, ulong t_o, int hd, float theta,
                              ulong f_o)
{
    const int i = get_global_id(0), n = get_global_id(1);
    const float ang = rope_angle((float)AT(const int, pos_o)[n], i, hd, theta, arena, f_o);
    AT(float, t_o)[n * hd + i] = cos(ang);
    AT(float, t_o)[n * hd + hd / 2 + i] = sin(ang);
}

// A draft tree's row (speculative decoding, policies/drafting.py Tree): besides its contiguous
// keys, key base + b of its sequence for each bit b of mask (its ancestors in the tree and
// itself, whose K/V this step wrote past the sequence's length), one key at a time into the
// same online softmax.
inline void att_tree(const __global float8* q, const __global kv8* k, const __global kv8* v,
                     const __global int* bt, int kw, int BR, float rsq, int base, ulong mask,
                     float* mx, float* sum, float8* acc)
{
    for (int b = 0; b < 64; b++) {
        if (!((mask >> b) & 1)) continue;
        const int l = base + b;
        const size_t row = (size_t)bt[l / BR] * BR + l % BR;
        const __global kv8* kr = k + row * kw;
        float8 d = 0.0f;
#pragma unroll
        for (int c = 0; c < HC; c++) d += q[c] * KV8(kr + c);
        const float s = hsum8(d) * rsq;
        if (s > *mx) {
            const float a = exp_f32(*mx - s);
            *sum *= a;
#pragma unroll
            for (int c = 0; c < HC; c++) acc[c] *= a;
            *mx = s;
        }
        const float w = exp_f32(s - *mx);
        *sum += w;
        const __global kv8* vr = v + row * kw;
#pragma unroll
        for (int c = 0; c < HC; c++) acc[c] += w * KV8(vr + c);
    }
}

// A row's tree entry (tm_o != 0: [N, 4] int32 L, base, mask low, mask high): a row whose mask
// is 0 sees keys 0 .. pos (a chain); else keys 0 .. L-1 and those of its mask (att_tree).
inline ulong tree_row(__global uchar* arena, ulong tm_o, int n, int* L, int* base)
{
    if (!tm_o) return 0;
    const __global int* tm = AT(const int, tm_o) + 4 * n;
    const ulong mask = (ulong)(uint)tm[2] | ((ulong)(uint)tm[3] << 32);
    if (mask) *L = tm[0], *base = tm[1];
    return mask;
}

// One query row's attention over keys 0 .. L-1 of a block table, ATT_CH keys a pass, for a CPU
// (ATT_WG 1: a work-item has the whole row): the pass's scores first (dot4),
// one max and one rescale a pass, their exponentials, then V weighted key by key into HC
// accumulators. ~20 vector operations a key, against ~50 for att_step8's online softmax of 8
// keys at a time. BR (block rows) is a power of two and a multiple of 8.
#define ATT_CH 64
inline void att_rows(const __global float8* q, const __global kv8* k, const __global kv8* v,
                     const __global int* bt, int kw, int lo, int L, int BR, float rsq, float* mx,
                     float* sum, float8* acc)
{
    const int sh = __builtin_ctz(BR);
    for (int l0 = lo & ~7; l0 < L; l0 += ATT_CH) {
        const int groups = (min(ATT_CH, L - l0) + 7) / 8;
        float8 sc[ATT_CH / 8];
        int base[ATT_CH / 8];                 // KV row of the group's first key
        float8 m8 = -INFINITY;
        for (int j = 0; j < groups; j++) {
            const int l = l0 + 8 * j;
            base[j] = (bt[l >> sh] << sh) + (l & (BR - 1));
            const __global kv8* kr[8];
#pragma unroll
            for (int t = 0; t < 8; t++)          // tail: re-read the last key (masked below)
                kr[t] = k + (size_t)(base[j] + (l + t < L ? t : L - 1 - l)) * kw;
            const float8 d0 = dot4(q, kr[0], kr[1], kr[2], kr[3]);
            const float8 d1 = dot4(q, kr[4], kr[5], kr[6], kr[7]);
            const int8 key = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + l;
            const int8 live = key < (int8)L && key >= (int8)lo;
            sc[j] = live ? ((float8)(d0.even, d1.even) + (float8)(d0.odd, d1.odd)) * rsq
                         : (float8)-INFINITY;
            m8 = sc[j] > m8 ? sc[j] : m8;
        }
        att_max(m8, mx, sum, acc);
        float8 s8 = 0.0f;
        for (int j = 0; j < groups; j++) {
            const int8 key = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + l0 + 8 * j;
            const int8 live = key < (int8)L && key >= (int8)lo;
            sc[j] = live ? exp8_f32(sc[j] - *mx) : (float8)0.0f;
            s8 += sc[j];
        }
        *sum += hsum8(s8);
        const float* p = (const float*)sc;
        for (int j = 0; j < groups; j++) {
            const int keys = min(8, L - l0 - 8 * j);
            const __global kv8* vr = v + (size_t)base[j] * kw;
            for (int t = 0; t < keys; t++, vr += kw) {
                const float w = p[8 * j + t];
#pragma unroll
                for (int c = 0; c < HC; c++) acc[c] += w * KV8(vr + c);
            }
        }
    }
}

#if ATT_WG == 1 && defined(ATT_G)
// att_rows for the ATT_G query heads that share one KV head (GQA), a work-item for them all: each
// key's K and V are read and converted from f16 once for the ATT_G heads, not once a head (their
// scores and weights are the heads' own; each head's online softmax as att_rows keeps it).
// q: head g's row at q + g HC; mx, sum [ATT_G]; acc [ATT_G HC]
inline void att_rows_g(const __global float8* q, const __global kv8* k, const __global kv8* v,
                       const __global int* bt, int kw, int lo, int L, int BR, float rsq, float* mx,
                       float* sum, float8* acc)
{
    const int sh = __builtin_ctz(BR);
    for (int l0 = lo & ~7; l0 < L; l0 += ATT_CH) {
        const int groups = (min(ATT_CH, L - l0) + 7) / 8;
        float8 sc[ATT_G][ATT_CH / 8];
        int base[ATT_CH / 8];
        float8 m8[ATT_G];
#pragma unroll
        for (int g = 0; g < ATT_G; g++) m8[g] = -INFINITY;
        for (int j = 0; j < groups; j++) {
            const int l = l0 + 8 * j;
            base[j] = (bt[l >> sh] << sh) + (l & (BR - 1));
            const int8 key = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + l;
            const int8 live = key < (int8)L && key >= (int8)lo;
            for (int h4 = 0; h4 < 8; h4 += 4) {          // keys l+h4 .. l+h4+3
                const __global kv8* kr[4];
#pragma unroll
                for (int t = 0; t < 4; t++)              // tail: re-read the last key (masked)
                    kr[t] = k + (size_t)(base[j] + (l + h4 + t < L ? h4 + t : L - 1 - l)) * kw;
                float8 d[ATT_G][4];
#pragma unroll
                for (int g = 0; g < ATT_G; g++)
#pragma unroll
                    for (int t = 0; t < 4; t++) d[g][t] = 0.0f;
#pragma unroll
                for (int c = 0; c < HC; c++) {
                    const float8 k0 = KV8(kr[0] + c), k1 = KV8(kr[1] + c);
                    const float8 k2 = KV8(kr[2] + c), k3 = KV8(kr[3] + c);
#pragma unroll
                    for (int g = 0; g < ATT_G; g++) {
                        const float8 qc = q[g * HC + c];
                        d[g][0] += qc * k0, d[g][1] += qc * k1, d[g][2] += qc * k2, d[g][3] += qc * k3;
                    }
                }
#pragma unroll
                for (int g = 0; g < ATT_G; g++) {     // dot4's transposed reduction
                    const float8 p01 = (float8)(d[g][0].even, d[g][1].even) + (float8)(d[g][0].odd, d[g][1].odd);
                    const float8 p23 = (float8)(d[g][2].even, d[g][3].even) + (float8)(d[g][2].odd, d[g][3].odd);
                    const float8 s4 = (float8)(p01.even, p23.even) + (float8)(p01.odd, p23.odd);
                    // s4 lanes (2t, 2t+1): halves of key h4+t's sum
                    const float4 s = s4.even + s4.odd;
                    if (h4 == 0) sc[g][j].lo = s; else sc[g][j].hi = s;
                }
            }
#pragma unroll
            for (int g = 0; g < ATT_G; g++) {
                sc[g][j] = live ? sc[g][j] * rsq : (float8)-INFINITY;
                m8[g] = sc[g][j] > m8[g] ? sc[g][j] : m8[g];
            }
        }
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            att_max(m8[g], mx + g, sum + g, acc + g * HC);
            float8 s8 = 0.0f;
            for (int j = 0; j < groups; j++) {
                const int8 key = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + l0 + 8 * j;
                const int8 live = key < (int8)L && key >= (int8)lo;
                sc[g][j] = live ? exp8_f32(sc[g][j] - mx[g]) : (float8)0.0f;
                s8 += sc[g][j];
            }
            sum[g] += hsum8(s8);
        }
        // V: key by key, each key's row read once for the ATT_G heads into their ATT_G * HC
        // accumulators (registers); 8 keys unrolled, so a key's weight is a fixed lane of sc
        for (int j = 0; j < groups; j++) {
            const int l = l0 + 8 * j;
#pragma unroll
            for (int t = 0; t < 8; t++) {       // tail: re-read the last key (its weight is 0)
                const __global kv8* vr = v + (size_t)(base[j] + (l + t < L ? t : L - 1 - l)) * kw;
                float p[ATT_G];
#pragma unroll
                for (int g = 0; g < ATT_G; g++) p[g] = ((const float*)&sc[g][j])[t];
#pragma unroll
                for (int c = 0; c < HC; c++) {
                    const float8 vc = KV8(vr + c);
#pragma unroll
                    for (int g = 0; g < ATT_G; g++) acc[g * HC + c] += p[g] * vc;
                }
            }
        }
    }
}

// attention_paged_g's row n for KV head kv (and attention_paged_gt's, where its rows are no run)
inline void att_row_g(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong out_o,
                      ulong pos_o, ulong seq_o, ulong btab_o, int H, int KVH, int BR, int MB,
                      int win, ulong tm_o, int kv, int n)
{
    const int kw = KVH * HC;
    const __global float8* q = AT(const float8, q_o) + ((size_t)n * H + kv * ATT_G) * HC;
    const __global kv8* k = AT(const kv8, k_o) + kv * HC;
    const __global kv8* v = AT(const kv8, v_o) + kv * HC;
    const __global int* bt = AT(const int, btab_o) + (size_t)AT(const int, seq_o)[n] * MB;
    const float rsq = 1.0f / sqrt((float)HEAD_DIM);
    int L = AT(const int, pos_o)[n] + 1, base = 0;
    const int lo = win_start(L, win);
    const ulong mask = tree_row(arena, tm_o, n, &L, &base);
    float8 acc[ATT_G * HC];
    float mx[ATT_G], sum[ATT_G];
#pragma unroll
    for (int i = 0; i < ATT_G * HC; i++) acc[i] = 0.0f;
#pragma unroll
    for (int g = 0; g < ATT_G; g++) mx[g] = -INFINITY, sum[g] = 0.0f;
    att_rows_g(q, k, v, bt, kw, lo, L, BR, rsq, mx, sum, acc);
#pragma unroll
    for (int g = 0; g < ATT_G; g++)
        if (mask) att_tree(q + g * HC, k, v, bt, kw, BR, rsq, base, mask, mx + g, sum + g, acc + g * HC);
    __global float8* out = AT(float8, out_o) + ((size_t)n * H + kv * ATT_G) * HC;
#pragma unroll
    for (int g = 0; g < ATT_G; g++)
#pragma unroll
        for (int c = 0; c < HC; c++) out[g * HC + c] = acc[g * HC + c] / sum[g];
}

// attention_paged for a KV head's ATT_G query heads at once (att_rows_g). global (1, KVH, N)
__kernel void attention_paged_g(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong out_o,
                                ulong pos_o, ulong seq_o, ulong btab_o, int H, int KVH, int BR, int MB,
                                int win, ulong tm_o)
{
    att_row_g(arena, q_o, k_o, v_o, out_o, pos_o, seq_o, btab_o, H, KVH, BR, MB, win, tm_o,
              get_global_id(1), get_global_id(2));
}

// A prefill chunk's attention a tile at a time (attention_paged_gt), as a CPU GEMM kernel would
// take it: ATT_R rows of one sequence at consecutive positions (a chunk's) and the ATT_G heads of
// one KV head are ATT_R ATT_G query vectors; they see keys 0 .. pos[n0]+R-1 (causal, no window,
// no tree), taken ATT_KB at a time. A block's K rows are converted from f16 once and transposed
// (kt: dimension-major, 8 keys a float8), its V rows converted once (vf); then the scores of 4
// query vectors against the block's keys (16 float8 accumulators, a query's element broadcast),
// an online softmax step per query vector over the block (lanes are keys: no reduction but the
// max and the sum), and V weighted into each query vector's accumulators (o, two query vectors
// at a time). A tile whose rows are not such a run (an embeddings chunk of several sequences)
// takes attention_paged_g's path row by row.
// global (1, KVH, ceil(N / ATT_R))
#define ATT_R 8                 // kernels.py ATT_TILE_ROWS
#define ATT_KB 32
#define ATT_QV (ATT_R * ATT_G)
inline void tr8(float8* r)      // rows r[0..7] -> r[e] = their elements e (an 8x8 transpose)
{
    const float8 t0 = __builtin_shufflevector(r[0], r[1], 0, 8, 1, 9, 4, 12, 5, 13);
    const float8 t1 = __builtin_shufflevector(r[0], r[1], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t2 = __builtin_shufflevector(r[2], r[3], 0, 8, 1, 9, 4, 12, 5, 13);
    const float8 t3 = __builtin_shufflevector(r[2], r[3], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t4 = __builtin_shufflevector(r[4], r[5], 0, 8, 1, 9, 4, 12, 5, 13);
    const float8 t5 = __builtin_shufflevector(r[4], r[5], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 t6 = __builtin_shufflevector(r[6], r[7], 0, 8, 1, 9, 4, 12, 5, 13);
    const float8 t7 = __builtin_shufflevector(r[6], r[7], 2, 10, 3, 11, 6, 14, 7, 15);
    const float8 u0 = __builtin_shufflevector(t0, t2, 0, 1, 8, 9, 4, 5, 12, 13);
    const float8 u1 = __builtin_shufflevector(t0, t2, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 u2 = __builtin_shufflevector(t1, t3, 0, 1, 8, 9, 4, 5, 12, 13);
    const float8 u3 = __builtin_shufflevector(t1, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 u4 = __builtin_shufflevector(t4, t6, 0, 1, 8, 9, 4, 5, 12, 13);
    const float8 u5 = __builtin_shufflevector(t4, t6, 2, 3, 10, 11, 6, 7, 14, 15);
    const float8 u6 = __builtin_shufflevector(t5, t7, 0, 1, 8, 9, 4, 5, 12, 13);
    const float8 u7 = __builtin_shufflevector(t5, t7, 2, 3, 10, 11, 6, 7, 14, 15);
    r[0] = __builtin_shufflevector(u0, u4, 0, 1, 2, 3, 8, 9, 10, 11);
    r[1] = __builtin_shufflevector(u1, u5, 0, 1, 2, 3, 8, 9, 10, 11);
    r[2] = __builtin_shufflevector(u2, u6, 0, 1, 2, 3, 8, 9, 10, 11);
    r[3] = __builtin_shufflevector(u3, u7, 0, 1, 2, 3, 8, 9, 10, 11);
    r[4] = __builtin_shufflevector(u0, u4, 4, 5, 6, 7, 12, 13, 14, 15);
    r[5] = __builtin_shufflevector(u1, u5, 4, 5, 6, 7, 12, 13, 14, 15);
    r[6] = __builtin_shufflevector(u2, u6, 4, 5, 6, 7, 12, 13, 14, 15);
    r[7] = __builtin_shufflevector(u3, u7, 4, 5, 6, 7, 12, 13, 14, 15);
}

__kernel void attention_paged_gt(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong out_o,
                                 ulong pos_o, ulong seq_o, ulong btab_o, int H, int KVH, int BR,
                                 int MB, int win, ulong tm_o, int N)
{
    const int kv = get_global_id(1), n0 = get_global_id(2) * ATT_R, kw = KVH * HC;
    const int nr = min(ATT_R, N - n0);
    const __global int* pos = AT(const int, pos_o);
    const __global int* sq = AT(const int, seq_o);
    int run = win == 0 && tm_o == 0;
    for (int i = 1; i < nr; i++)
        run = run && sq[n0 + i] == sq[n0] && pos[n0 + i] == pos[n0] + i;
    if (!run) {
        for (int i = 0; i < nr; i++)
            att_row_g(arena, q_o, k_o, v_o, out_o, pos_o, seq_o, btab_o, H, KVH, BR, MB, win, tm_o,
                      kv, n0 + i);
        return;
    }
    const __global kv8* k = AT(const kv8, k_o) + kv * HC;
    const __global kv8* v = AT(const kv8, v_o) + kv * HC;
    const __global int* bt = AT(const int, btab_o) + (size_t)sq[n0] * MB;
    const float rsq = 1.0f / sqrt((float)HEAD_DIM);
    const int p0 = pos[n0], L = p0 + nr, sh = __builtin_ctz(BR), nq = nr * ATT_G;
    // query vector j = i ATT_G + g: row n0 + i, head kv ATT_G + g, at qrow(j)
#define QROW(j) (AT(const float, q_o) + ((size_t)(n0 + (j) / ATT_G) * H + kv * ATT_G + (j) % ATT_G) * HEAD_DIM)
    float8 kt[HEAD_DIM * (ATT_KB / 8)];     // kt[d (KB/8) + u]: dim d of keys 8u .. 8u+7
    float8 vf[ATT_KB * HC];                 // vf[t HC + c]: key t's dims 8c .. 8c+7
    float8 o[ATT_QV * HC];
    float p[ATT_QV * ATT_KB], mx[ATT_QV], sm[ATT_QV], sc[ATT_QV];
    for (int j = 0; j < ATT_QV * HC; j++) o[j] = 0.0f;
    for (int j = 0; j < ATT_QV; j++) mx[j] = -INFINITY, sm[j] = 0.0f;
    for (int l0 = 0; l0 < L; l0 += ATT_KB) {
        const int nk = min(ATT_KB, L - l0);
        for (int u = 0; u < ATT_KB / 8; u++) {
            // 8 keys never straddle a KV block (BR % 8 == 0): one table lookup for them, at the
            // group that holds key l (or, past L, the last group: its keys are masked below)
            const int l = l0 + 8 * u, first = min(l, (L - 1) & ~7);
            const int base = (bt[first >> sh] << sh) + (first & (BR - 1));
            const __global kv8* kr[8];
#pragma unroll
            for (int t = 0; t < 8; t++) {       // keys past L re-read the last (masked below)
                const size_t row = (size_t)(base + min(l + t, L - 1) - first) * kw;
                kr[t] = k + row;
#pragma unroll
                for (int c = 0; c < HC; c++) vf[(8 * u + t) * HC + c] = KV8(v + row + c);
            }
            for (int c = 0; c < HC; c++) {
                float8 r[8];
#pragma unroll
                for (int t = 0; t < 8; t++) r[t] = KV8(kr[t] + c);
                tr8(r);
#pragma unroll
                for (int e = 0; e < 8; e++) kt[(8 * c + e) * (ATT_KB / 8) + u] = r[e];
            }
        }
        // scores, 4 query vectors at a time, into p (then the softmax step in place)
        for (int j0 = 0; j0 < nq; j0 += 4) {
            float8 s[4][ATT_KB / 8];
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int u = 0; u < ATT_KB / 8; u++) s[a][u] = 0.0f;
            const __global float* qa[4];
#pragma unroll
            for (int a = 0; a < 4; a++) qa[a] = QROW(min(j0 + a, nq - 1));
            for (int d = 0; d < HEAD_DIM; d++) {
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    const float qd = qa[a][d];
#pragma unroll
                    for (int u = 0; u < ATT_KB / 8; u++) s[a][u] += qd * kt[d * (ATT_KB / 8) + u];
                }
            }
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const int j = j0 + a, Li = p0 + j / ATT_G + 1;
                if (j >= nq)
                    break;
                if (l0 >= Li) {                 // none of these keys (causal): nothing changes
                    sc[j] = 1.0f;
                    for (int t = 0; t < ATT_KB; t++) p[j * ATT_KB + t] = 0.0f;
                    continue;
                }
                float8 m8 = -INFINITY;
#pragma unroll
                for (int u = 0; u < ATT_KB / 8; u++) {
                    const int8 key = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + l0 + 8 * u;
                    s[a][u] = key < (int8)Li ? s[a][u] * rsq : (float8)-INFINITY;
                    m8 = fmax(m8, s[a][u]);
                }
                const float4 m4 = fmax(m8.lo, m8.hi);
                const float2 m2 = fmax(m4.lo, m4.hi);
                const float m = fmax(mx[j], fmax(m2.x, m2.y));
                float8 acc = 0.0f;
#pragma unroll
                for (int u = 0; u < ATT_KB / 8; u++) {
                    const int8 key = (int8)(0, 1, 2, 3, 4, 5, 6, 7) + l0 + 8 * u;
                    const float8 e = key < (int8)Li ? exp8_f32(s[a][u] - m) : (float8)0.0f;
                    acc += e;
                    vstore8(e, 0, p + j * ATT_KB + 8 * u);
                }
                sc[j] = exp(mx[j] - m);
                sm[j] = sm[j] * sc[j] + hsum8(acc);
                mx[j] = m;
            }
        }
        // o = o sc + p V, two query vectors at a time
        for (int j = 0; j < nq; j += 2) {
            const int j1 = min(j + 1, nq - 1);
            float8 oa[HC], ob[HC];
#pragma unroll
            for (int c = 0; c < HC; c++) oa[c] = o[j * HC + c] * sc[j], ob[c] = o[j1 * HC + c] * sc[j1];
            for (int t = 0; t < nk; t++) {
                const float pa = p[j * ATT_KB + t], pb = p[j1 * ATT_KB + t];
#pragma unroll
                for (int c = 0; c < HC; c++) {
                    const float8 vc = vf[t * HC + c];
                    oa[c] += pa * vc, ob[c] += pb * vc;
                }
            }
#pragma unroll
            for (int c = 0; c < HC; c++) o[j * HC + c] = oa[c];
            if (j1 != j)
#pragma unroll
                for (int c = 0; c < HC; c++) o[j1 * HC + c] = ob[c];
        }
    }
#undef QROW
    for (int j = 0; j < nq; j++) {
        __global float8* out = AT(float8, out_o) + ((size_t)(n0 + j / ATT_G) * H + kv * ATT_G + j % ATT_G) * HC;
        for (int c = 0; c < HC; c++) out[c] = o[j * HC + c] / sm[j];
    }
}
#endif

// The start of one query row's paged attention, head h of row n (attention_paged,
// attention_hcmp): its q, its KV head's K and V, its block table, the keys it sees (L, lo, a
// tree's base and mask) and an empty online softmax (mx, sum, acc).
#define PAGED_ROW_START                                                                          \
    const int kv = h / (H / KVH), kw = KVH * HC;                                                 \
    const __global float8* q = AT(const float8, q_o) + ((size_t)n * H + h) * HC;                 \
    const __global kv8* k = AT(const kv8, k_o) + kv * HC;                                        \
    const __global kv8* v = AT(const kv8, v_o) + kv * HC;                                        \
    const __global int* bt = AT(const int, btab_o) + (size_t)AT(const int, seq_o)[n] * MB;      \
    const float rsq = 1.0f / sqrt((float)HEAD_DIM);                                              \
    int L = AT(const int, pos_o)[n] + 1, base = 0;                                               \
    const int lo = win_start(L, win);                                                            \
    const ulong mask = tree_row(arena, tm_o, n, &L, &base);                                      \
    float8 acc[HC];                                                                              \
    _Pragma("unroll")                                                                            \
    for (int c = 0; c < HC; c++) acc[c] = 0.0f;                                                  \
    float mx = -INFINITY, sum = 0.0f;

// attention over paged K/V: row n (sequence seq[n], position pos[n]) sees keys 0 .. pos[n] of its
// sequence (win > 0: the last win of them), key l at KV row btab[seq][l / BR] * BR + l % BR; a
// draft tree's row, its tree entry's keys (tree_row).
// global (ATT_WG, H, N)
__kernel void attention_paged(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong out_o,
                              ulong pos_o, ulong seq_o, ulong btab_o, int H, int KVH, int BR, int MB,
                              int win, ulong tm_o)
{
    const int t = get_local_id(0), h = get_global_id(1), n = get_global_id(2);
    PAGED_ROW_START
#if ATT_WG == 1
    att_rows(q, k, v, bt, kw, lo, L, BR, rsq, &mx, &sum, acc);
#else
    for (int l = (lo & ~7) + 8 * t; l < L; l += 8 * ATT_WG) {
        const long shift = (long)(bt[l / BR] * BR + l % BR - l) * kw;   // keys l.. of this block
        att_step8(q, k + shift, v + shift, kw, l, lo, L, rsq, &mx, &sum, acc);
    }
#endif
    if (mask && t == 0)
        att_tree(q, k, v, bt, kw, BR, rsq, base, mask, &mx, &sum, acc);
    __local float part_mx[ATT_WG], part_sum[ATT_WG];
    __local float8 part_acc[ATT_WG * HC];
    att_store(AT(float8, out_o) + ((size_t)n * H + h) * HC, t, mx, sum, acc, part_mx, part_sum,
              part_acc);
}

// lm_head of every row: x [N, D], table Q8_0 [V, D] -> out [N, V]; each table row is read once
// for all N rows (LM_TN at a time).  global (V rounded up, ceil(N / LM_TN))
#define LM_TN GEMM_TN
__kernel void lm_head_rows(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong out_o,
                           int D, int V, int N)
{
    const int r = get_global_id(0), n0 = get_global_id(1) * LM_TN;
    if (r >= V) return;
    const int nb = D / QK;
    const __global char16* q = AT(const char16, qs_o) + (size_t)r * (D / 16);
    const __global ushort* d = AT(const ushort, d_o) + (size_t)r * nb;
    const __global float8* x[LM_TN];
    float8 acc[LM_TN];
#pragma unroll
    for (int i = 0; i < LM_TN; i++) {
        x[i] = AT(const float8, x_o) + (size_t)(n0 + i < N ? n0 + i : N - 1) * (D / 8);
        acc[i] = 0.0f;
    }
    for (int b = 0; b < nb; b++) {
        const char16 q0 = q[2 * b], q1 = q[2 * b + 1];
        const float8 w0 = convert_float8(q0.lo), w1 = convert_float8(q0.hi);
        const float8 w2 = convert_float8(q1.lo), w3 = convert_float8(q1.hi);
        const float s = HALF(d, b);
#pragma unroll
        for (int i = 0; i < LM_TN; i++) {
            const __global float8* xb = x[i] + 4 * b;
            acc[i] += ((w0 * xb[0] + w1 * xb[1]) + (w2 * xb[2] + w3 * xb[3])) * s;
        }
    }
#pragma unroll
    for (int i = 0; i < LM_TN; i++)
        if (n0 + i < N) AT(float, out_o)[(size_t)(n0 + i) * V + r] = hsum8(acc[i]);
}

#if defined(Q8_X86) && defined(__AVX512F__)
// lm_head_rows on AVX-512 (CLKernels launches it where a build has it): two table rows a
// work-item, each block's 32 weights times its scale first (exact in f32: |q| <= 128 times an
// f16), then one fma a value, row and table row, 16 lanes at a time: each 16 values of x loaded
// once for both table rows (lm_head_rows' float8 form is bound by its loads of x). The sums
// differ from lm_head_rows' by rounding only.  global (ceil(V / 2) rounded up, ceil(N / LM_TN))
typedef float float16u __attribute__((ext_vector_type(16), aligned(4)));   // unaligned loads
typedef char char32u __attribute__((ext_vector_type(32), aligned(1)));
__kernel void lm_head_rows2(__global uchar* arena, ulong x_o, ulong qs_o, ulong d_o, ulong out_o,
                            int D, int V, int N)
{
    const int r = 2 * get_global_id(0), n0 = get_global_id(1) * LM_TN;
    if (r >= V) return;
    const int r1 = r + 1 < V ? r + 1 : r, nb = D / QK;      // an odd V: the last row twice
    const __global char* qa = AT(const char, qs_o) + (size_t)r * D;
    const __global char* qb = AT(const char, qs_o) + (size_t)r1 * D;
    const __global ushort* da = AT(const ushort, d_o) + (size_t)r * nb;
    const __global ushort* db = AT(const ushort, d_o) + (size_t)r1 * nb;
    const __global float* x[LM_TN];
    // accumulators [table row][row]; up to 4 rows a second pair for the blocks' high halves:
    // fma chains of one a block, not two (their latency would bind a few rows)
#define LM_H (LM_TN <= 4 ? 2 : 1)
    float16 acc[LM_H][LM_TN], acc1[LM_H][LM_TN];
#pragma unroll
    for (int i = 0; i < LM_TN; i++) {
        x[i] = AT(const float, x_o) + (size_t)(n0 + i < N ? n0 + i : N - 1) * D;
#pragma unroll
        for (int h = 0; h < LM_H; h++) acc[h][i] = acc1[h][i] = 0.0f;
    }
    __builtin_prefetch(da + 2 * nb);              // the next pair's scales and, a line a block,
    for (int b = 0; b < nb; b++) {                // its 2 D bytes of weights (nb = 2 D / 64)
        __builtin_prefetch(qa + 2 * D + 64 * b);
        const char32u va = *(const __global char32u*)(qa + QK * b);
        const char32u vb = *(const __global char32u*)(qb + QK * b);
        const float sa = HALF(da, b), sb = HALF(db, b);
        const float16 a0 = CVT(va.lo, float16) * sa, a1 = CVT(va.hi, float16) * sa;
        const float16 b0 = CVT(vb.lo, float16) * sb, b1 = CVT(vb.hi, float16) * sb;
#pragma unroll
        for (int i = 0; i < LM_TN; i++) {
            const __global float16u* xb = (const __global float16u*)(x[i] + QK * b);
            const float16 x0 = xb[0], x1 = xb[1];
            acc[0][i] = FMAV(a0, x0, acc[0][i]);
            acc1[0][i] = FMAV(b0, x0, acc1[0][i]);
            acc[LM_H - 1][i] = FMAV(a1, x1, acc[LM_H - 1][i]);
            acc1[LM_H - 1][i] = FMAV(b1, x1, acc1[LM_H - 1][i]);
        }
    }
#pragma unroll
    for (int i = 0; i < LM_TN; i++)
        if (n0 + i < N) {
            const float16 ya = LM_H == 2 ? acc[0][i] + acc[LM_H - 1][i] : acc[0][i];
            const float16 yb = LM_H == 2 ? acc1[0][i] + acc1[LM_H - 1][i] : acc1[0][i];
            __global float* o = AT(float, out_o) + (size_t)(n0 + i) * V + r;
            o[0] = hsum8(ya.lo + ya.hi);
            if (r + 1 < V) o[1] = hsum8(yb.lo + yb.hi);
        }
}
#undef LM_H
#endif

// ---- a decode batch's linears with prepared (int16 / int8) activations (precision q16 / q8) ----
// prep_rows: x [N, K] -> prepared rows (decode.cl's act format), row n at s_o + n * row_bytes;
// rows n >= N (a launch padded to whole tiles, batch.cl) repeat row N-1. prep_rows_nat: each
// block's values in their own order (prep_block natural), for lm_head_tile's Q8_0 rows.
// global (K/32 rounded up, rows)
inline void prep_rows_at(__global uchar* arena, ulong x_o, ulong s_o, int K, int row_bytes, int N,
                         int natural)
{
    const int b = get_global_id(0), n = get_global_id(1);
    if (b >= K / QK) return;
    const __global float8* x = AT(const float8, x_o) + (size_t)(n < N ? n : N - 1) * (K / 8) + 4 * b;
    prep_block(x[0], x[1], x[2], x[3], arena, s_o + (ulong)n * row_bytes, K, b, natural);
}
__kernel void prep_rows(__global uchar* arena, ulong x_o, ulong s_o, int K, int row_bytes, int N)
{
    prep_rows_at(arena, x_o, s_o, K, row_bytes, N, 0);
}
__kernel void prep_rows_nat(__global uchar* arena, ulong x_o, ulong s_o, int K, int row_bytes, int N)
{
    prep_rows_at(arena, x_o, s_o, K, row_bytes, N, 1);
}

#ifndef W_FLT
// linear_rows_act: N prepared rows, W Q4_1 [M, K] -> out [N, M] in rows ld wide (row n at rows[n]
// if rows_o != 0). A work-item takes weight row r against GEMM_TN activation rows: each weight
// block is loaded once and multiplied in integers (decode.cl's block_dot) with every row's.
// global (M rounded up to LIN_R, ceil(N / GEMM_TN)), local (LIN_R, 1)
__kernel void linear_rows_act(__global uchar* arena, ulong s_o, ulong qs_o, ulong d_o, ulong m_o,
                              ulong out_o, int K, int M, int N, int ld, ulong rows_o, int row_bytes,
                              ulong b_o)
{
    const int r = get_global_id(0), n0 = get_global_id(1) * GEMM_TN;
    if (r >= M) return;
    const int nb = K / QK;
    W_ROW(r, nb);
    const __global uchar* xv[GEMM_TN];
    const __global float* dx[GEMM_TN];
    float8 acc[GEMM_TN];
    float macc[GEMM_TN];
#pragma unroll
    for (int i = 0; i < GEMM_TN; i++) {   // tail rows repeat row N-1; they are not stored
        xv[i] = AT(const uchar, s_o + (ulong)(n0 + i < N ? n0 + i : N - 1) * row_bytes);
        dx[i] = (const __global float*)(xv[i] + (size_t)ACT_BYTES * K);
        acc[i] = 0.0f;
        macc[i] = 0.0f;
    }
    for (int b = 0; b < nb; b++) {
#if W_Q4_1
        const uchar16 w = q[b];
        const float dw = HALF(d, b), mw = HALF(m, b);
#pragma unroll
        for (int i = 0; i < GEMM_TN; i++) {
            acc[i] += block_dot(w, xv[i], b) * (dw * dx[i][b]);
            macc[i] += mw * dx[i][nb + b];          // m * (block sum of x)
        }
#else
#pragma unroll
        for (int i = 0; i < GEMM_TN; i++)
            acc[i] += w_block_dot(q, d, m, b, xv[i], dx[i], dx[i] + nb, &macc[i]);
#endif
    }
    const float bias = b_o ? AT(const float, b_o)[r] : 0.0f;     // b_o != 0: a bias [M]
#pragma unroll
    for (int i = 0; i < GEMM_TN; i++)
        if (n0 + i < N && rows_o)   // KV row rows[n] (paged KV)
            KV_PUT(AT(kv_t, out_o), (size_t)AT(const int, rows_o)[n0 + i] * ld + r,
                   hsum8(acc[i]) + macc[i] + bias);
        else if (n0 + i < N)
            AT(float, out_o)[(size_t)(n0 + i) * ld + r] = hsum8(acc[i]) + macc[i] + bias;
}
#endif

// Ghidorah §III-B2 (HCMP): a verifying step's attention split into its dense part, the keys
// 0 .. L-1 of the KV cache (part 0), and its sparse part, the draft tree's keys of the row's
// tree entry (part 1), each computed alone with its own softmax (online softmax), on different
// processors; attention_merge rescales and sums them. A part's row: the H heads' outputs,
// normalized [H * hd], then each head's log-sum-exp of its scores [H] (-inf: no key), in a row
// of `cols` floats. One work-item per (head, row). global (1, H, N)
__kernel void attention_hcmp(__global uchar* arena, ulong q_o, ulong k_o, ulong v_o, ulong out_o,
                             ulong pos_o, ulong seq_o, ulong btab_o, int H, int KVH, int BR, int MB,
                             int win, ulong tm_o, int part, int cols)
{
    const int h = get_global_id(1), n = get_global_id(2);
    PAGED_ROW_START
    if (part == 0 && lo < L)
        att_rows(q, k, v, bt, kw, lo, L, BR, rsq, &mx, &sum, acc);
    else if (part == 1 && mask)
        att_tree(q, k, v, bt, kw, BR, rsq, base, mask, &mx, &sum, acc);
    __global float* row = AT(float, out_o) + (size_t)n * cols;
    __global float8* o = (__global float8*)(row + (size_t)h * HEAD_DIM);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int c = 0; c < HC; c++) o[c] = acc[c] * inv;
    row[H * HEAD_DIM + h] = sum > 0.0f ? mx + log(sum) : -INFINITY;
}

// The two parts' rows -> out [N, H * hd]: each head's outputs weighted by its part's share of
// the softmax's sum, e^(lse_part - lse_max) / (e^(lse_a - lse_max) + e^(lse_b - lse_max)).
// global (HEAD_DIM / 8, H, N)
__kernel void attention_merge_parts(__global uchar* arena, ulong a_o, ulong b_o, ulong out_o,
                                    int H, int cols)
{
    const int c = get_global_id(0), h = get_global_id(1), n = get_global_id(2);
    const __global float* a = AT(const float, a_o) + (size_t)n * cols;
    const __global float* b = AT(const float, b_o) + (size_t)n * cols;
    const float la = a[H * HEAD_DIM + h], lb = b[H * HEAD_DIM + h];
    const float m = fmax(la, lb);
    const float wa = la == -INFINITY ? 0.0f : exp(la - m), wb = lb == -INFINITY ? 0.0f : exp(lb - m);
    const size_t at = (size_t)h * HC + c;
    const float8 oa = ((const __global float8*)a)[at], ob = ((const __global float8*)b)[at];
    (AT(float8, out_o) + (size_t)n * H * HC)[at] = (oa * wa + ob * wb) / (wa + wb);
}
