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
