"""CLKernels (OpenCL; PoCL on the CPU here) against the numpy specification, op by op.

Each test lays its tensors out in one uint8 arena at 64-byte-aligned offsets, runs NumpyKernels on a
copy of the arena and CLKernels on the arena itself (wrapped zero-copy), and checks that
  - the outputs agree: |cl - np| <= RTOL * (max|np| + |np|), RTOL = 1e-5: f32 sums in another
    order (PoCL measured under 1e-6 on every op);
  - every other byte of the arena is untouched (no out-of-range writes, KV rows before pos0 kept).
"""
from __future__ import annotations

import os

os.environ.setdefault("POCL_MAX_PTHREAD_COUNT", "2")  # before pyopencl starts PoCL


import numpy as np
import pytest

import pyopencl  # noqa: F401  (a hard dependency: missing or broken, this file fails)

from socllm.actors.gpu.device import GPU_SHAPED, Mirror, discrete, make_context, wrap_arena
from socllm.actors.gpu.kernels import ATT_TILE_FROM, CLKernels
from socllm.actors.gpu.refs import prepared_row_bytes
from socllm.actors.cpu.kernels import KV_NUMPY, NumpyKernels
from socllm.graph.program import cut_rows
from socllm.models.quant import FORMATS, QK, planar, repack_q4_1
from socllm.models.synthetic import blocks, random_blocks

RTOL = 1e-5
D, F, H, KVH, HD, V = 576, 1536, 9, 3, 64, 49152   # SmolLM2-135M
ARENA_BYTES = 48 << 20
GUARD = 4096                                         # bytes past the layout that must stay zero


class Layout:
    """A bump allocator over the shared test arena: put() arrays, get refs back."""

    def __init__(self, arena: np.ndarray):
        self.arena, self.top = arena, 0
        arena[:] = 0

    def put(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        off = self.top
        self.arena[off: off + a.nbytes] = a.reshape(-1).view(np.uint8)
        self.top = (off + a.nbytes + 63) // 64 * 64
        return off

    def zeros(self, shape, dtype=np.float32) -> int:
        return self.put(np.zeros(shape, dtype))

    def w4(self, M, K, rng) -> tuple:
        qs = rng.integers(0, 256, (M, K // 2), dtype=np.uint8)
        d = rng.uniform(0.001, 0.02, (M, K // QK)).astype(np.float16)
        m = rng.uniform(-0.1, 0.1, (M, K // QK)).astype(np.float16)
        d.flat[::7], m.flat[::5], m.flat[1::5] = 3e-5, 0.0, -2e-6   # f16 subnormals and zeros
        return ("w4", self.put(qs), self.put(d), self.put(m))

    def wq(self, fmt, M, K, rng) -> tuple:
        """A matrix in a block format (models/quant.py), from random GGUF blocks whose scales are
        finite: every code pattern."""
        size = {"Q4_K": 2e-3, "Q5_K": 1e-3, "Q6_K": 5e-4}.get(fmt, 0.02)
        raw = random_blocks(fmt, M, K, rng, lambda n: rng.uniform(-1, 1, n) * size)
        p = planar(fmt, raw, M, K)
        return ("wq", fmt, self.put(p["qs"]), self.put(p["dm"]), self.put(p["qh"]) if "qh" in p else 0)

    def w8(self, V, D, rng) -> tuple:
        qs = rng.integers(-128, 128, (V, D), dtype=np.int8)
        d = rng.uniform(0.001, 0.02, (V, D // QK)).astype(np.float16)
        return ("w8", self.put(qs), self.put(d))


@pytest.fixture(scope="module")
def dev():
    """One context, arena and program build for the module: PoCL compiles the program, then each
    kernel per work-group size at its first launch (cached in ~/.cache/pocl; ~6 s cold here)."""
    ctx, queue, device = make_context()
    raw = np.zeros(ARENA_BYTES + 4096, np.uint8)
    start = -raw.ctypes.data % 4096                  # page-aligned, as the pool's arena is
    arena = raw[start: start + ARENA_BYTES]
    # a discrete GPU (or SOCLLM_CL_DISCRETE=1 on PoCL): the arena copied whole around each run
    mirror = Mirror(arena) if discrete(ctx) else None
    return arena, CLKernels(ctx, queue, wrap_arena(ctx, arena), mirror=mirror)


@pytest.fixture(scope="module")
def dev16(dev):
    """The module's arena with kernels built for an f16 KV cache (memory/layout.py kv_dtype)."""
    arena, clk = dev
    return arena, CLKernels(clk.ctx, clk.queue, clk.buf, kv_dtype="f16", mirror=clk.mirror), "f16"


@pytest.fixture(scope="module", params=["f32", "f16"])
def kvdev(dev, dev16, request):
    """(arena, kernels, kv dtype) for an f32 or an f16 KV cache."""
    return (*dev, "f32") if request.param == "f32" else dev16


@pytest.fixture
def lay(dev):
    return Layout(dev[0])


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def check(dev, lay, op, args, N, pos0, outs, clk=None, atol=RTOL, kv="f32", out_kv=False):
    """Run op both ways; outs = [(byte offset, nbytes)] of the output ranges (f32, or KV rows of
    type kv if out_kv); atol is relative to the largest output value. kv: the KV cache's elements
    (clk must be built for them)."""
    arena, clk = dev[0], clk or dev[1]
    end = lay.top + GUARD
    ref = arena[:end].copy()
    NumpyKernels(ref, kv).run(op, args, N, pos0)
    clk.run(op, args, N, pos0)
    clk.finish()
    got = arena[:end]
    mask = np.zeros(end, bool)
    dtype = KV_NUMPY[kv] if out_kv else np.float32
    rtol = 1e-3 if dtype == np.float16 else RTOL       # f16 rounding of sums in another order
    for off, nbytes in outs:
        mask[off: off + nbytes] = True
        g, w = (a[off: off + nbytes].view(dtype).astype(np.float32) for a in (got, ref))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=max(atol, rtol) * float(np.abs(w).max()))
    assert np.array_equal(got[~mask], ref[~mask]), "bytes outside the output changed"


def rows(lay, rng, n, cols, scale=1.0) -> int:
    return lay.put((rng.standard_normal((n, cols)) * scale).astype(np.float32))


# -- row-wise ops ------------------------------------------------------------------------------
@pytest.mark.parametrize("N", [1, 33, 300])
def test_rmsnorm_matches_numpy(dev, lay, rng, N):
    x, w = rows(lay, rng, N, D), lay.put(rng.uniform(0.5, 1.5, D).astype(np.float32))
    out = lay.zeros((N, D))
    check(dev, lay, "rmsnorm", {"x": ("a", x), "w": ("wf", w), "out": ("a", out), "D": D,
                                "eps": 1e-5}, N, 0, [(out, N * D * 4)])


@pytest.mark.parametrize("N", [1, 33, 300])
def test_silu_mul_matches_numpy(dev, lay, rng, N):
    g, u, out = rows(lay, rng, N, F, 4.0), rows(lay, rng, N, F), lay.zeros((N, F))
    check(dev, lay, "silu_mul", {"g": ("a", g), "u": ("a", u), "out": ("a", out), "F": F},
          N, 0, [(out, N * F * 4)])


@pytest.mark.parametrize("N", [1, 33])
def test_gelu_mul_matches_numpy(dev, lay, rng, N):
    g, u, out = rows(lay, rng, N, F, 4.0), rows(lay, rng, N, F), lay.zeros((N, F))
    check(dev, lay, "gelu_mul", {"g": ("a", g), "u": ("a", u), "out": ("a", out), "F": F},
          N, 0, [(out, N * F * 4)])


@pytest.mark.parametrize("N", [1, 33, 300])
def test_add_matches_numpy(dev, lay, rng, N):
    a, b, out = rows(lay, rng, N, D), rows(lay, rng, N, D), lay.zeros((N, D))
    check(dev, lay, "add", {"a": ("a", a), "b": ("a", b), "out": ("a", out), "D": D},
          N, 0, [(out, N * D * 4)])


@pytest.mark.parametrize("N", [1, 33, 300])
def test_embed_gathers_dequantized_rows(dev, lay, rng, N):
    Vs = 1000
    table = lay.w8(Vs, D, rng)
    ids = lay.put(rng.integers(0, Vs, N).astype(np.int32))
    out = lay.zeros((N, D))
    check(dev, lay, "embed", {"ids": ("a", ids), "table": table, "out": ("a", out), "V": Vs,
                              "D": D}, N, 0, [(out, N * D * 4)])
    check(dev, lay, "embed", {"ids": ("a", ids), "table": table, "out": ("a", out), "V": Vs,
                              "D": D, "scale": 24.0}, N, 0, [(out, N * D * 4)])   # Gemma: sqrt(D)


# -- linear: GEMV (N == 1) and GEMM (N > 1) ----------------------------------------------------
MODEL_LINEARS = [(D, F), (F, D), (D, KVH * HD)]   # (K, M): gate/up, down, k/v


def _some(values: list, slow: list) -> list:
    """A grid's values, those in `slow` only under -m slow: the default run keeps the edges (one
    row, a tile's rows, past a whole tile) and the full grid stays one flag away."""
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            if v in slow else v for v in values]


@pytest.mark.parametrize("N,K,M", [(n, k, m) for n in (1, 33, 300) for k, m in MODEL_LINEARS]
                         + [(1, 64, 37), (33, 64, 37)])
def test_linear_w4a16_matches_numpy(dev, lay, rng, N, K, M):
    x, w, out = rows(lay, rng, N, K), lay.w4(M, K, rng), lay.zeros((N, M))
    check(dev, lay, "linear", {"x": ("a", x), "w": w, "out": ("a", out), "K": K, "M": M},
          N, 0, [(out, N * M * 4)])


@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize("N", [1, 33])
def test_row_cut_halves_write_the_whole_linear_into_one_slot(dev, lay, rng, N, fmt):
    """HeteroLLM §4.1 row-cut: two halves (graph/program.cut_rows, which moves every plane of a
    weight: codes, scales, high bits) write their columns of one [N, M] slot; together they
    equal the uncut linear, and nothing else is touched."""
    K, M, cut = (D, F, 1024) if fmt == "Q4_1" else (512, 40, 24)
    w = lay.w4(M, K, rng) if fmt == "Q4_1" else lay.wq(fmt, M, K, rng)
    x, out = rows(lay, rng, N, K), lay.zeros((N, M))
    whole = {"x": ("a", x), "w": w, "out": ("a", out), "K": K, "M": M}
    want = lay.arena[:lay.top + GUARD].copy()
    NumpyKernels(want).run("linear", whole, N, 0)
    arena, clk = dev
    for lo, hi in ((0, cut), (cut, M)):
        clk.run("linear", cut_rows(whole, lo, hi), N, 0)
    clk.finish()
    got = arena[:lay.top + GUARD]
    g, r = got[out: out + N * M * 4].view(np.float32), want[out: out + N * M * 4].view(np.float32)
    np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * float(np.abs(r).max()))
    assert np.array_equal(got[:out], want[:out]) and np.array_equal(got[out + N * M * 4:], want[out + N * M * 4:])
    # the numpy specification's halves are the whole too
    ref = lay.arena[:lay.top + GUARD].copy()
    ref[out: out + N * M * 4] = 0
    for lo, hi in ((cut, M), (0, cut)):
        NumpyKernels(ref).run("linear", cut_rows(whole, lo, hi), N, 0)
    np.testing.assert_allclose(ref[out: out + N * M * 4].view(np.float32), r, rtol=1e-6, atol=1e-6 * float(np.abs(r).max()))
    assert np.array_equal(ref[:out], want[:out])


@pytest.mark.parametrize("N", [1, 33])
def test_linear_writes_kv_rows_at_pos0(dev, lay, rng, N):
    pos0, cap, M = 37, 128, KVH * HD
    x, w = rows(lay, rng, N, D), lay.w4(M, D, rng)
    cache = rows(lay, rng, cap, M)                   # rows before pos0 must survive
    check(dev, lay, "linear", {"x": ("a", x), "w": w, "out": ("kv", cache), "K": D, "M": M},
          N, pos0, [(cache + pos0 * M * 4, N * M * 4)])


@pytest.fixture(scope="module")
def ffn_down(model_path):
    """blk.0.ffn_down of SmolLM2-135M: a real Q4_1 weight [576, 1536], repacked planar."""
    import gguf
    t = next(t for t in gguf.GGUFReader(model_path).tensors if t.name == "blk.0.ffn_down.weight")
    M, K = t.data.shape[0], int(t.shape[0])               # GGUF shape is [K, M]
    return repack_q4_1(np.asarray(t.data), M, K), K, M


@pytest.mark.parametrize("N", [1, 33])
def test_linear_real_gguf_weight(dev, lay, rng, ffn_down, N):
    p, K, M = ffn_down
    w = ("w4", lay.put(p["qs"]), lay.put(p["d"]), lay.put(p["m"]))
    x, out = rows(lay, rng, N, K), lay.zeros((N, M))
    check(dev, lay, "linear", {"x": ("a", x), "w": w, "out": ("a", out), "K": K, "M": M},
          N, 0, [(out, N * M * 4)])


# -- rope and attention ------------------------------------------------------------------------
@pytest.mark.parametrize("N,pos0", [(1, 0), (33, 37), (300, 0), (1, 300)])
def test_rope_rotates_pairs(dev, lay, rng, N, pos0):
    x, out = rows(lay, rng, N, H * HD), lay.zeros((N, H * HD))
    # an f32 angle pos * theta^(-2i/hd) is rounded to ~pos * 6e-8 rad, and OpenCL's pow/sin/cos
    # may round differently from numpy's: the outputs agree to ~pos * 1.2e-7 of their size
    check(dev, lay, "rope", {"x": ("a", x), "out": ("a", out), "heads": H, "head_dim": HD,
                             "theta": 100000.0}, N, pos0, [(out, N * H * HD * 4)],
          atol=max(RTOL, (pos0 + N) * 1.2e-7))


@pytest.mark.parametrize("N,pos0", [(1, 37), (33, 37)])
def test_rope_writes_kv_rows_at_pos0(dev, lay, rng, N, pos0):
    cap, cols = 128, KVH * HD
    x, cache = rows(lay, rng, N, cols), rows(lay, rng, cap, cols)
    check(dev, lay, "rope", {"x": ("a", x), "out": ("kv", cache), "heads": KVH, "head_dim": HD,
                             "theta": 100000.0}, N, pos0, [(cache + pos0 * cols * 4, N * cols * 4)])


def check_attention(dev, lay, rng, N, pos0, clk=None, window=0):
    L = pos0 + N
    q = rows(lay, rng, N, H * HD)
    cache = rng.standard_normal((2, L + 3, KVH * HD)).astype(np.float32)
    cache[0] *= 2.0                                       # K: sharper softmax
    cache[:, L:] = np.nan                                 # rows past L: must not be read, even x 0
    k, v = lay.put(cache[0]), lay.put(cache[1])
    out = lay.zeros((N, H * HD))
    check(dev, lay, "attention", {"q": ("a", q), "k": ("kv", k), "v": ("kv", v), "out": ("a", out),
                                  "heads": H, "kv_heads": KVH, "head_dim": HD,
                                  **({"window": window} if window else {})}, N, pos0,
          [(out, N * H * HD * 4)], clk=clk)


@pytest.mark.parametrize("N,pos0", [(1, 0), (1, 37), (33, 0), (33, 37), (300, 0), (1, 511)])
def test_attention_causal_gqa(dev, lay, rng, N, pos0):
    check_attention(dev, lay, rng, N, pos0)


@pytest.fixture(scope="module", params=[64, 7], ids=["wg64", "wg7"])
def split_k(dev, request):
    """The attention a GPU gets: each row's keys split over a work-group of ATT_WG work-items (8-key
    blocks dealt round-robin), partial softmaxes merged in local memory; 7 is odd and < 8 chunks."""
    clk = dev[1]
    return CLKernels(clk.ctx, clk.queue, clk.buf, f"-DATT_WG={request.param}", mirror=clk.mirror)


@pytest.mark.parametrize("L", [1, 37, 1000, 2049])
def test_attention_decode_long_kv(dev, lay, rng, L):
    check_attention(dev, lay, rng, 1, L - 1)


@pytest.mark.parametrize("N,L", [(1, 1), (1, 37), (1, 1000), (1, 2049), (5, 1000), (33, 37)])
def test_attention_split_k_merges_partials(dev, lay, rng, split_k, N, L):
    """L = 1 and 37 leave work-items without keys (empty partials weigh 0); 2049 a 1-key tail."""
    check_attention(dev, lay, rng, N, L - N, clk=split_k)


@pytest.mark.parametrize("N,pos0,window", [(1, 37, 5), (1, 36, 37), (33, 37, 13), (300, 0, 64),
                                           (1, 1000, 512), (7, 20, 1)])
def test_attention_sliding_window_sees_only_the_last_keys(dev, lay, rng, split_k, N, pos0, window):
    """Gemma 3's sliding-window layers: row n sees keys pos0+n-window+1 .. pos0+n (the first key
    anywhere in an 8-key block, and a window wider than the row's keys: all of them)."""
    check_attention(dev, lay, rng, N, pos0, window=window)
    check_attention(dev, lay, rng, N, pos0, clk=split_k, window=window)


def test_attention_other_head_dim(dev, lay, rng):
    N, pos0, hd = 5, 11, 32
    q, out = rows(lay, rng, N, 4 * hd), lay.zeros((N, 4 * hd))
    k, v = rows(lay, rng, N + pos0, 2 * hd), rows(lay, rng, N + pos0, 2 * hd)
    check(dev, lay, "attention", {"q": ("a", q), "k": ("kv", k), "v": ("kv", v), "out": ("a", out),
                                  "heads": 4, "kv_heads": 2, "head_dim": hd}, N, pos0,
          [(out, N * 4 * hd * 4)])


# -- lm_head -----------------------------------------------------------------------------------
@pytest.mark.parametrize("Vs,N", [(V, 1), (1000, 7)])
def test_lm_head_logits_of_last_row(dev, lay, rng, Vs, N):
    x, table, out = rows(lay, rng, N, D), lay.w8(Vs, D, rng), lay.zeros(Vs)
    check(dev, lay, "lm_head", {"x": ("a", x), "table": table, "out": ("a", out), "D": D, "V": Vs},
          N, 0, [(out, Vs * 4)])


def test_arena_buffer_is_zero_copy(dev, lay):
    """On host-unified memory the kernels write the pool itself: no map, no copy back."""
    arena, clk = dev
    if clk.mirror is not None:
        pytest.skip("discrete device: outputs are copied back by the caller")
    a, b, out = lay.put(np.ones(64, np.float32)), lay.put(np.full(64, 2, np.float32)), lay.zeros(64)
    clk.run("add", {"a": ("a", a), "b": ("a", b), "out": ("a", out), "D": 64}, 1, 0)
    clk.finish()
    assert (arena[out: out + 256].view(np.float32) == 3).all()


def test_clones_share_one_invoker_made_once_and_each_keeps_its_own_arguments(dev, lay):
    """gpu/device.py keeps pyopencl's invokers in memory: kernels cloned for recorded launches
    (gpu/launches.py) make theirs once (pyopencl went to its on-disk cache for every clone), and
    each clone still adds its own rows."""
    import pyopencl.invoker
    arena, clk = dev
    kept = pyopencl.invoker.generate_enqueue_and_set_args.kept
    kept.clear()
    ones, out = lay.put(np.ones(128, np.float32)), lay.zeros(128)
    twos = lay.put(np.full(128, 2, np.float32))
    clones = [clk.clone(clk.k, "add", (ones, b, out + 256 * i, 64)) for i, b in enumerate((ones, twos))]
    assert len(kept) == 1
    clk.upload()
    for knl in clones:
        pyopencl.enqueue_nd_range_kernel(clk.queue, knl, (64,), (64,))
    clk.finish()
    got = arena[out: out + 512].view(np.float32)         # a discrete device's copied back
    assert (got[:64] == 2).all() and (got[64:] == 3).all()


def test_a_kernel_builds_options_name_no_folder_of_this_install(dev):
    """PoCL keys its kernel cache by a build's source and options: pyopencl's own include folder
    (a path inside this venv) among them made every new venv or fresh clone compile every kernel
    again. gpu/device.py drops it; the kernels' own options stay."""
    import os

    import pyopencl
    _, clk = dev
    opts, _ = pyopencl.Program._process_build_options(clk.ctx, f"{clk.options} -DHEAD_DIM=64")
    assert os.path.dirname(pyopencl.__file__).encode() not in opts and b"-I" not in opts.split()
    assert b"-DHEAD_DIM=64" in opts and clk.options.split()[0].encode() in opts


def test_gpu_tuning_and_portable_path_match_numpy(dev, lay, rng):
    """The build a GPU gets: GEMV rows split over work-items with a local-memory reduction,
    vload_half instead of the x86 F16C shortcut, another GEMM tile (odd, to hit the token tail)."""
    arena, clk = dev
    gpuish = CLKernels(clk.ctx, clk.queue, clk.buf, "-DLIN_T=4 -DLIN_R=2 -DGEMM_TN=3 -DSOCLLM_PORTABLE",
                       mirror=clk.mirror)
    assert (gpuish.lin_t, gpuish.lin_r, gpuish.gemm_tn) == (4, 2, 3)
    K, M, Vs = F, 37, 100
    x, w, table = rows(lay, rng, 7, K), lay.w4(M, K, rng), lay.w8(Vs, K, rng)
    ids = lay.put(rng.integers(0, Vs, 7).astype(np.int32))
    outs = {"lin": lay.zeros((7, M)), "emb": lay.zeros((7, K)), "lm": lay.zeros(Vs)}
    for N in (1, 7):
        check(dev, lay, "linear", {"x": ("a", x), "w": w, "out": ("a", outs["lin"]), "K": K, "M": M},
              N, 0, [(outs["lin"], N * M * 4)], clk=gpuish)
    check(dev, lay, "embed", {"ids": ("a", ids), "table": table, "out": ("a", outs["emb"]), "V": Vs,
                              "D": K}, 7, 0, [(outs["emb"], 7 * K * 4)], clk=gpuish)
    check(dev, lay, "lm_head", {"x": ("a", x), "table": table, "out": ("a", outs["lm"]), "D": K,
                                "V": Vs}, 7, 0, [(outs["lm"], Vs * 4)], clk=gpuish)
    nw = lay.put(rng.uniform(0.5, 1.5, K).astype(np.float32))   # a row over the work-group
    check(dev, lay, "rmsnorm", {"x": ("a", x), "w": ("wf", nw), "out": ("a", outs["emb"]), "D": K,
                                "eps": 1e-5}, 7, 0, [(outs["emb"], 7 * K * 4)], clk=gpuish)


def test_misaligned_offsets_raise_instead_of_faulting(dev, lay, rng):
    x, w, out = rows(lay, rng, 1, D), lay.w4(F, D, rng), lay.zeros((1, F))
    with pytest.raises(ValueError, match="multiples of 32"):
        dev[1].run("linear", {"x": ("a", x + 4), "w": w, "out": ("a", out), "K": D, "M": F}, 1, 0)


# -- decode GEMVs on a prepared activation row (gpu/fused.py): f32, int16 (q16), int8 (q8) -------
ACT_OFF, ROPE_OFF = ARENA_BYTES - (1 << 20), ARENA_BYTES - (1 << 19)   # past a free gap
BITS = {"f32": 32, "q16": 16, "q8": 8}


def linear_act_reference(x, qs, d, m, K, M, bits):
    """The decode GEMV in numpy (f64 sums): x as prep stores it — f32, or per 32-block
    dx = max|x| / qmax (f32), q = round-half-away(x * (1/dx)) — then
    sum_b d * dx * sum(q_w * q_x) + m * dx * sum(q_x): the rounded x's block sum, as llama.cpp's
    Q8_1 keeps it (the weights times the rounded x, exactly)."""
    xb = x.reshape(K // QK, QK)
    if bits == 32:
        qx, dx = xb.astype(np.float64), np.ones(K // QK)
    else:
        dx = np.abs(xb).max(axis=1) / np.float32(127 if bits == 8 else 32767)
        inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
        t = xb * inv[:, None]
        qx = np.trunc(t + np.copysign(np.float32(0.5), t))
    qw = np.stack([qs & 0x0F, qs >> 4], axis=-1).reshape(M, K // QK, QK).astype(np.float64)
    dots = np.einsum("mbj,bj->mb", qw, qx.astype(np.float64))
    sx = dx * qx.sum(axis=1, dtype=np.float64)
    return (d.astype(np.float64) * dx * dots + m.astype(np.float64) * sx).sum(axis=1)


@pytest.fixture(scope="module", params=["", "-DSOCLLM_PORTABLE -DLIN_R=2", GPU_SHAPED],
                ids=["avx2", "portable", "gpu-shaped"])
def build(dev, request):
    """The x86 build (AVX2 integer dot products, F16C), the portable one, and the portable one
    with a GPU's work shapes (a row pair's blocks over LIN_T work-items, epilogues over a group)."""
    clk = dev[1]
    return CLKernels(clk.ctx, clk.queue, clk.buf, request.param, mirror=clk.mirror)


def linear_act(clk, precision, x, w, out, K, M, pos0=0, res=None, pos_word=False):
    from socllm.actors.gpu.fused import FusedCL
    from socllm.graph.fuse import Fused
    f = FusedCL(clk, ACT_OFF, ROPE_OFF, precision, pos_word=pos_word)
    f.run(Fused("prep", {"x": x, "K": K}), 1, pos0)
    f.run(Fused("linear_act", {"x": x, "w": w, "out": out, "res": res, "K": K, "M": M}), 1, pos0)
    clk.finish()


@pytest.mark.parametrize("precision", ["f32", "q16", "q8"])
@pytest.mark.parametrize("K,M", MODEL_LINEARS + [(64, 37), (288, 5)])
def test_linear_act_matches_its_numpy_reference(dev, lay, rng, build, precision, K, M):
    arena = dev[0]
    xv = rng.standard_normal(K).astype(np.float32)
    xv[:QK] = 0.0                                    # an all-zero block: dx = 0
    x, w, out = lay.put(xv), lay.w4(M, K, rng), lay.zeros(M)
    _, qs, d, m = w
    before = arena[:lay.top + GUARD].copy()
    linear_act(build, precision, ("a", x), w, ("a", out), K, M)
    got = arena[out: out + 4 * M].view(np.float32)
    want = linear_act_reference(xv, arena[qs: qs + M * K // 2].reshape(M, K // 2),
                                arena[d: d + M * K // 16].view(np.float16).reshape(M, K // QK),
                                arena[m: m + M * K // 16].view(np.float16).reshape(M, K // QK),
                                K, M, BITS[precision])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))
    after = arena[:lay.top + GUARD]
    after[out: out + 4 * M] = before[out: out + 4 * M]
    assert np.array_equal(after, before), "bytes outside the output and the scratch changed"


@pytest.mark.parametrize("precision,tol", [("f32", RTOL), ("q16", 1e-4), ("q8", 1e-2)])
@pytest.mark.parametrize("K,M", MODEL_LINEARS)
def test_linear_act_is_as_close_to_f32_as_its_bits(dev, lay, rng, precision, tol, K, M):
    """Against the op-by-op f32 GEMV: f32 only reassociates, int16 activations cost ~3e-5 of
    the output's scale on random data, int8 ~1e-2."""
    x, w, out, out32 = rows(lay, rng, 1, K), lay.w4(M, K, rng), lay.zeros(M), lay.zeros(M)
    dev[1].run("linear", {"x": ("a", x), "w": w, "out": ("a", out32), "K": K, "M": M}, 1, 0)
    linear_act(dev[1], precision, ("a", x), w, ("a", out), K, M)
    got, want = (dev[0][o: o + 4 * M].view(np.float32) for o in (out, out32))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * float(np.abs(want).max()))


def test_linear_act_adds_the_residual_and_writes_kv_rows(dev, lay, rng):
    pos0, cap, M = 37, 128, KVH * HD
    x, w, cache = rows(lay, rng, 1, D), lay.w4(M, D, rng), rows(lay, rng, cap, M)
    res, plain, out = rows(lay, rng, 1, M), lay.zeros(M), lay.zeros(M)
    linear_act(dev[1], "f32", ("a", x), w, ("a", plain), D, M)
    linear_act(dev[1], "f32", ("a", x), w, ("a", out), D, M, res=("a", res))

    def f32(o, n=M):
        return dev[0][o: o + 4 * n].view(np.float32)
    np.testing.assert_allclose(f32(out), f32(plain) + f32(res), rtol=1e-6, atol=1e-6)
    before = f32(cache, cap * M).reshape(cap, M).copy()
    linear_act(dev[1], "f32", ("a", x), w, ("kv", cache), D, M, pos0=pos0)
    after = f32(cache, cap * M).reshape(cap, M)
    np.testing.assert_array_equal(after[pos0], f32(plain))
    keep = np.arange(cap) != pos0
    np.testing.assert_array_equal(after[keep], before[keep])
    # with the step's position word (GPUBackend): the row it names, whatever pos0 the call says
    from socllm.actors.gpu.fused import pos_word_at
    dev[0][pos_word_at(ROPE_OFF):][:4].view(np.int32)[0] = pos0 + 1
    before = after.copy()
    linear_act(dev[1], "f32", ("a", x), w, ("kv", cache), D, M, pos0=0, pos_word=True)
    after = f32(cache, cap * M).reshape(cap, M)
    np.testing.assert_array_equal(after[pos0 + 1], f32(plain))
    keep = np.arange(cap) != pos0 + 1
    np.testing.assert_array_equal(after[keep], before[keep])


def test_fused_scratch_must_be_aligned(dev):
    from socllm.actors.gpu.fused import FusedCL
    with pytest.raises(ValueError, match="64-byte"):
        FusedCL(dev[1], ACT_OFF + 32, ROPE_OFF)


@pytest.mark.parametrize("precision,tol", [("f32", RTOL), ("q16", 1e-4), ("q8", 2e-2)])
def test_lm_head_act_matches_numpy(dev, lay, rng, build, precision, tol):
    """The final norm prepared in natural order, then the Q8_0 lm-head (two rows a work-item)."""
    from socllm.actors.gpu.fused import FusedCL
    from socllm.graph.fuse import Fused
    Vs = 1001                                         # odd: the last work-item has one row
    x, w, table = rows(lay, rng, 1, D), lay.put(rng.uniform(0.5, 1.5, D).astype(np.float32)), lay.w8(Vs, D, rng)
    xn, out = lay.zeros(D), lay.zeros(Vs)
    ref = dev[0].copy()
    spec = NumpyKernels(ref)
    spec.run("rmsnorm", {"x": ("a", x), "w": ("wf", w), "out": ("a", xn), "D": D, "eps": 1e-5}, 1, 0)
    spec.run("lm_head", {"x": ("a", xn), "table": table, "out": ("a", out), "D": D, "V": Vs}, 1, 0)
    f = FusedCL(build, ACT_OFF, ROPE_OFF, precision)
    f.run(Fused("norm_prep", {"x": ("a", x), "w": ("wf", w), "out": ("a", xn), "D": D, "eps": 1e-5,
                              "store": False, "natural": True}), 1, 0)
    f.run(Fused("lm_head_act", {"x": ("a", xn), "table": table, "out": ("a", out), "D": D, "V": Vs}), 1, 0)
    build.finish()
    got, want = (a[out: out + 4 * Vs].view(np.float32) for a in (dev[0], ref))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * float(np.abs(want).max()))
    assert not dev[0][xn: xn + 4 * D].any()           # store=False: the normalized row stays unwritten


# -- paged KV and batched rows (cl/paged.cl): a serving step's rows at their own positions -------
BR = 16                                               # memory/blocks.BLOCK_ROWS


def paged_meta(lay, rng, lengths, n_blocks=40):
    """Sequences of these lengths over shuffled blocks (a table not in order); the step's rows are
    each sequence's last position. -> (pos, rows, seq, btab refs, [phys rows per sequence], MB)"""
    MB = max(-(-L // BR) for L in lengths)
    ids = rng.permutation(n_blocks)
    tables, k = [], 0
    for L in lengths:
        tables.append(ids[k: k + -(-L // BR)])
        k += len(tables[-1])
    btab = np.full((len(lengths), MB), 10**6, np.int32)   # unused entries: far out of range
    for s, t in enumerate(tables):
        btab[s, :len(t)] = t
    pos = np.array([L - 1 for L in lengths], np.int32)
    phys = [btab[s, np.arange(L) // BR] * BR + np.arange(L) % BR for s, L in enumerate(lengths)]
    rows_ = np.array([p[-1] for p in phys], np.int32)
    return (("a", lay.put(pos)), ("a", lay.put(rows_)), ("a", lay.put(np.arange(len(lengths), dtype=np.int32))),
            ("a", lay.put(btab)), phys, MB)


@pytest.mark.parametrize("group", [True, False], ids=["per-kv-head", "per-head"])
@pytest.mark.parametrize("window", [0, 13])
@pytest.mark.parametrize("lengths", [[1], [37, 5, 16, 17, 300], [16, 32, 48]])
def test_paged_attention_equals_contiguous_attention_per_sequence(kvdev, lay, rng, lengths, window,
                                                                  group):
    """per-kv-head: attention_paged_g, a work-item for the 3 query heads of a KV head (a CPU
    device's form); per-head: attention_paged, a work-item a head (a model without GQA)."""
    arena, clk, kv = kvdev
    saved, clk.att_group = clk.att_group, group
    try:
        _paged_attention_case(arena, clk, kv, lay, rng, lengths, window)
    finally:
        clk.att_group = saved


def _paged_attention_case(arena, clk, kv, lay, rng, lengths, window):
    kvdev = (arena, clk, kv)
    kvt, kvb = KV_NUMPY[kv], np.dtype(KV_NUMPY[kv]).itemsize
    n_blocks, cols = 40, KVH * HD
    pos, rows_, seq, btab, phys, MB = paged_meta(lay, rng, lengths, n_blocks)
    cache = rng.standard_normal((2, n_blocks * BR, cols)).astype(kvt)
    used = np.zeros(n_blocks * BR, bool)
    for p in phys:
        used[p] = True
    cache[:, ~used] = np.nan                          # rows of no sequence: never read
    k, v = lay.put(cache[0] * 2.0), lay.put(cache[1])
    N = len(lengths)
    q, out = rows(lay, rng, N, H * HD), lay.zeros((N, H * HD))
    args = {"q": ("a", q), "k": ("kv", k), "v": ("kv", v), "out": ("a", out), "pos": pos,
            "seq": seq, "btab": btab, "heads": H, "kv_heads": KVH, "head_dim": HD,
            "block_rows": BR, "max_blocks": MB, **({"window": window} if window else {})}
    check(kvdev, lay, "attention", args, N, 0, [(out, N * H * HD * 4)], clk=clk, kv=kv)
    # the paged numpy spec is the contiguous f32 one over each sequence's rows gathered in order
    got = arena[out: out + N * H * HD * 4].view(np.float32).reshape(N, H * HD)
    for n, p in enumerate(phys):
        ref = np.zeros(1 << 22, np.uint8)
        L = len(p)
        kk, vv = (arena[o: o + n_blocks * BR * cols * kvb].view(kvt).reshape(-1, cols)[p]
                  .astype(np.float32) for o in (k, v))
        qq = got[n] * 0 + arena[q: q + N * H * HD * 4].view(np.float32).reshape(N, -1)[n]
        offs = [0, L * cols * 4, 2 * L * cols * 4, 2 * L * cols * 4 + H * HD * 4]
        for o, a in zip(offs, (kk, vv, qq)):
            ref[o: o + a.nbytes] = a.reshape(-1).view(np.uint8)
        NumpyKernels(ref).run("attention", {"q": ("a", offs[2]), "k": ("kv", 0), "v": ("kv", offs[1]),
                                            "out": ("a", offs[3]), "heads": H, "kv_heads": KVH,
                                            "head_dim": HD, "window": window}, 1, L - 1)
        want = ref[offs[3]: offs[3] + H * HD * 4].view(np.float32)
        np.testing.assert_allclose(got[n], want, rtol=1e-5, atol=1e-5)


def _paged_cache(lay, rng, kvt, n_blocks, cols, phys) -> tuple:
    """K and V caches in the pool (K scaled: scores of some spread) whose rows of no sequence
    are NaN: a kernel that reads one fails."""
    cache = rng.standard_normal((2, n_blocks * BR, cols)).astype(kvt)
    used = np.zeros(n_blocks * BR, bool)
    for p in phys:
        used[p] = True
    cache[:, ~used] = np.nan
    return lay.put(cache[0] * 2.0), lay.put(cache[1])


def _run_paged(kvdev, lay, args, N, q, out, group: bool) -> tuple:
    """The paged attention step both ways (check: numpy's kernel agrees, nothing else in the
    pool changed) -> (its output [N, H*HD], its queries)."""
    arena, clk, kv = kvdev
    saved, clk.att_group = clk.att_group, group
    try:
        check(kvdev, lay, "attention", args, N, 0, [(out, N * H * HD * 4)], clk=clk, kv=kv)
    finally:
        clk.att_group = saved
    return (arena[out: out + N * H * HD * 4].view(np.float32).reshape(N, H * HD),
            arena[q: q + N * H * HD * 4].view(np.float32).reshape(N, -1))


def _spec_attention(arena, kv, k, v, n_blocks, q_row, keys, window=0) -> np.ndarray:
    """The spec of one paged row: numpy's contiguous f32 attention over exactly the KV rows
    `keys`, gathered in order, the row seeing them all (window: the last of them)."""
    kvt, cols = KV_NUMPY[kv], KVH * HD
    kvb, L = np.dtype(kvt).itemsize, len(keys)
    kk, vv = (arena[o: o + n_blocks * BR * cols * kvb].view(kvt).reshape(-1, cols)[keys]
              .astype(np.float32) for o in (k, v))
    ref = np.zeros(1 << 22, np.uint8)
    offs = [0, L * cols * 4, 2 * L * cols * 4, 2 * L * cols * 4 + H * HD * 4]
    for o, a in zip(offs, (kk, vv, q_row.copy())):
        ref[o: o + a.nbytes] = a.reshape(-1).view(np.uint8)
    NumpyKernels(ref).run("attention", {"q": ("a", offs[2]), "k": ("kv", 0), "v": ("kv", offs[1]),
                                        "out": ("a", offs[3]), "heads": H, "kv_heads": KVH,
                                        "head_dim": HD, "window": window}, 1, L - 1)
    return ref[offs[3]: offs[3] + H * HD * 4].view(np.float32)


@pytest.mark.parametrize("window", [0, 13])
@pytest.mark.parametrize("runs", [[(37, 5), (5, 1), (300, 9), (16, 16)], [(9, 3), (30, 2), (31, 1)],
                                  [(300, 45)], [(40, 20), (70, 17)], [(33, 33)]])
def test_paged_attention_of_a_sequences_consecutive_rows_sees_each_rows_own_keys(kvdev, lay, rng,
                                                                                 runs, window):
    """A step's rows of one sequence at consecutive positions (drafted tokens being verified, a
    prefill chunk), beside other sequences' rows: each row attends to its own keys 0 .. pos (the
    rows after it in the step are in the cache already, and must not be seen); runs: (sequence
    length, rows: its last positions). From ATT_TILE_FROM rows (a chunk: no tree) the rows go in
    tiles of 8 (paged.cl attention_paged_gt): a later chunk of one prompt (45 rows from position
    255), two prompts in one chunk (a tile holding rows of both takes the row-by-row path), a
    prompt's first chunk; with a window, every tile goes row by row."""
    arena, clk, kv = kvdev
    kvt = KV_NUMPY[kv]
    n_blocks, cols = 40, KVH * HD
    lengths = [L for L, _ in runs]
    MB = max(-(-L // BR) for L in lengths)
    ids, tables, b = rng.permutation(n_blocks), [], 0
    for L in lengths:
        tables.append(ids[b: b + -(-L // BR)])
        b += len(tables[-1])
    btab = np.full((len(lengths), MB), 10**6, np.int32)
    for s, t in enumerate(tables):
        btab[s, :len(t)] = t
    phys = [btab[s, np.arange(L) // BR] * BR + np.arange(L) % BR for s, L in enumerate(lengths)]
    row_seq = np.array([s for s, (L, n) in enumerate(runs) for _ in range(n)], np.int32)
    row_pos = np.array([p for L, n in runs for p in range(L - n, L)], np.int32)
    N = len(row_pos)
    k, v = _paged_cache(lay, rng, kvt, n_blocks, cols, phys)
    q, out = rows(lay, rng, N, H * HD), lay.zeros((N, H * HD))
    args = {"q": ("a", q), "k": ("kv", k), "v": ("kv", v), "out": ("a", out),
            "pos": ("a", lay.put(row_pos)), "seq": ("a", lay.put(row_seq)), "btab": ("a", lay.put(btab)),
            "heads": H, "kv_heads": KVH, "head_dim": HD, "block_rows": BR, "max_blocks": MB,
            **({"window": window} if window else {})}
    got, qs = _run_paged(kvdev, lay, args, N, q, out, True)
    for n in range(N):
        want = _spec_attention(arena, kv, k, v, n_blocks, qs[n], phys[row_seq[n]][:row_pos[n] + 1], window)
        np.testing.assert_allclose(got[n], want, rtol=1e-5, atol=1e-5, err_msg=f"row {n}")


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (8, 2, 128), (16, 2, 128)])
def test_prefill_chunk_tiles_at_other_head_shapes(kvdev, lay, rng, heads, kv_heads, head_dim):
    """A later prefill chunk of 40 rows (positions 30 .. 69 of one prompt, its KV blocks out of
    order) at other GQA shapes than SmolLM2's (Qwen's, Llama's: 2, 4 and 8 query heads a KV head,
    head sizes 64 and 128): the tiled kernel (paged.cl attention_paged_gt, ATT_G and HC of the
    build) against numpy's paged attention, nothing else in the pool changed."""
    arena, clk, kv = kvdev
    kvt = KV_NUMPY[kv]
    L, N, n_blocks, cols = 70, 40, 12, kv_heads * head_dim
    table = rng.permutation(n_blocks)[: -(-L // BR)].astype(np.int32)
    phys = table[np.arange(L) // BR] * BR + np.arange(L) % BR
    k, v = _paged_cache(lay, rng, kvt, n_blocks, cols, [phys])
    q, out = rows(lay, rng, N, heads * head_dim), lay.zeros((N, heads * head_dim))
    args = {"q": ("a", q), "k": ("kv", k), "v": ("kv", v), "out": ("a", out),
            "pos": ("a", lay.put(np.arange(L - N, L, dtype=np.int32))),
            "seq": ("a", lay.put(np.zeros(N, np.int32))), "btab": ("a", lay.put(table[None, :])),
            "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_rows": BR,
            "max_blocks": len(table)}
    assert N >= ATT_TILE_FROM
    check(kvdev, lay, "attention", args, N, 0, [(out, N * heads * head_dim * 4)], clk=clk, kv=kv)


# draft trees (policies/drafting.py Tree): parents of nodes 0 .. T-1 (-1: the root), ranks 0 along
# the chain from the root; a small tree, and a wide one whose masks reach past bit 32
TREES = {"small": ([-1, 0, 1, -1, 3, 0, 2], [0, 0, 0, 1, 0, 1, 0]),
         "wide": ([-1, 0] + [1] * 36 + [37, 38, 2], [0, 0] + [0] + [1] * 35 + [0, 0, 1])}


@pytest.mark.parametrize("group", [True, False], ids=["per-kv-head", "per-head"])
@pytest.mark.parametrize("tree", list(TREES))
def test_paged_attention_of_a_draft_tree_sees_the_prefix_and_each_nodes_ancestors(kvdev, lay, rng,
                                                                                  tree, group):
    """A sequence's root row and its draft tree's rows beside another sequence's row: a node on
    the chain sees keys 0 .. its position; any other node the prefix (0 .. root) and its own
    ancestors' keys and its own, which the step wrote past the chain (never its siblings' or
    their subtrees'); numpy's paged kernel and the spec (contiguous attention over exactly those
    keys, gathered in order) agree, and nothing else in the pool changes."""
    from socllm.policies.drafting import Tree
    arena, clk, kv = kvdev
    kvt = KV_NUMPY[kv]
    parents, ranks = TREES[tree]
    t = Tree(list(range(len(parents))), parents, ranks)
    root = 29                                            # the tree's rows: KV 30 .. 30 + T - 1
    node_pos, node_at, ent = t.entries(root)
    lengths = [root + 1 + len(t), 45]                    # KV rows each sequence holds
    n_blocks, cols = 40, KVH * HD
    pos_, rows_, seq_, btab, phys, MB = paged_meta(lay, rng, lengths, n_blocks)
    bt = arena[btab[1]: btab[1] + 4 * 2 * MB].view(np.int32).reshape(2, MB)
    row_seq = np.array([0] * (1 + len(t)) + [1], np.int32)
    row_pos = np.array([root, *node_pos, 44], np.int32)
    row_at = np.array([root, *node_at, 44], np.int32)
    tm = np.concatenate([np.zeros((1, 4), np.int32), ent, np.zeros((1, 4), np.int32)])
    N = len(row_pos)
    k, v = _paged_cache(lay, rng, kvt, n_blocks, cols, phys)
    q, out = rows(lay, rng, N, H * HD), lay.zeros((N, H * HD))
    args = {"q": ("a", q), "k": ("kv", k), "v": ("kv", v), "out": ("a", out),
            "pos": ("a", lay.put(row_pos)), "seq": ("a", lay.put(row_seq)), "btab": btab,
            "tmask": ("a", lay.put(tm)), "heads": H, "kv_heads": KVH, "head_dim": HD,
            "block_rows": BR, "max_blocks": MB}
    got, qs = _run_paged(kvdev, lay, args, N, q, out, group)
    for n in range(N):
        if n == 0 or n == N - 1:                          # the root, the other sequence
            keys = list(range(row_pos[n] + 1))
        else:                                             # the spec: the prefix, then the path
            path, a = [], n - 1
            while a >= 0:
                path.append(root + 1 + a)
                a = parents[a]
            keys = list(range(root + 1)) + path[::-1]
            if n - 1 < t.chain:                           # a chain node: its own position
                assert keys == list(range(row_pos[n] + 1)) and row_at[n] == row_pos[n]
        p = np.asarray(keys)
        want = _spec_attention(arena, kv, k, v, n_blocks, qs[n], bt[row_seq[n], p // BR] * BR + p % BR)
        np.testing.assert_allclose(got[n], want, rtol=1e-5, atol=1e-5, err_msg=f"row {n}")


@pytest.mark.parametrize("tree", list(TREES))
def test_hcmp_splits_a_verifying_steps_attention_into_dense_and_sparse_parts_that_merge_exactly(
        kvdev, lay, rng, tree):
    """Ghidorah §III-B2 (graph/hcmp.py): the draft tree above beside another sequence's lone row,
    the entries hcmp_entries gives (chain rows: their sequence's drafted keys sparse). Each part
    (dense: the KV cache's keys 0 .. L-1; sparse: the entry's tree keys) and the merge run in
    OpenCL and numpy alike, touching only their outputs; the merged rows are the whole paged
    attention's, and a part's log-sum-exp is -inf where it has no key (the first row's dense
    part at position 0 has none)."""
    from socllm.graph.hcmp import part_cols
    from socllm.policies.drafting import Tree, hcmp_entries
    arena, clk, kv = kvdev
    parents, ranks = TREES[tree]
    t = Tree(list(range(len(parents))), parents, ranks)
    root = 29
    node_pos, node_at, ent = t.entries(root)
    lengths = [root + 1 + len(t), 1]
    n_blocks, cols = 40, KVH * HD
    pos_, rows_, seq_, btab, phys, MB = paged_meta(lay, rng, lengths, n_blocks)
    row_seq = np.array([0] * (1 + len(t)) + [1], np.int32)
    row_pos = np.array([root, *node_pos, 0], np.int32)
    tm = hcmp_entries(row_pos, row_seq, np.concatenate([np.zeros((1, 4), np.int32), ent,
                                                        np.zeros((1, 4), np.int32)]))
    assert tuple(tm[0, :3]) == (root, root, 1) and tuple(tm[-1, :3]) == (0, 0, 1)
    N, pc = len(row_pos), part_cols(H, HD)
    k, v = _paged_cache(lay, rng, KV_NUMPY[kv], n_blocks, cols, phys)
    q, whole = rows(lay, rng, N, H * HD), lay.zeros((N, H * HD))
    args = {"q": ("a", q), "k": ("kv", k), "v": ("kv", v), "pos": ("a", lay.put(row_pos)),
            "seq": ("a", lay.put(row_seq)), "btab": btab, "tmask": ("a", lay.put(tm)), "heads": H,
            "kv_heads": KVH, "head_dim": HD, "block_rows": BR, "max_blocks": MB}
    parts = {}
    for part in ("dense", "sparse"):
        parts[part] = out = lay.zeros((N, pc))
        end = lay.top + GUARD
        a, ref = {**args, "out": ("a", out), "part": part, "cols": pc}, arena[:end].copy()
        NumpyKernels(ref, kv).run("attention", a, N, 0)
        clk.run("attention", a, N, 0)
        clk.finish()
        got, want = (x[out: out + N * pc * 4].view(np.float32).reshape(N, pc) for x in (arena, ref))
        np.testing.assert_allclose(got[:, :H * HD], want[:, :H * HD], rtol=1e-5,
                                   atol=1e-5 * float(np.abs(want[:, :H * HD]).max()))
        np.testing.assert_allclose(got[:, H * HD:], want[:, H * HD:], rtol=1e-5, atol=1e-5)
        outside = np.ones(end, bool)
        outside[out: out + N * pc * 4] = False
        assert np.array_equal(arena[:end][outside], ref[outside]), "bytes outside the output changed"
    lse = arena[parts["dense"]: parts["dense"] + N * pc * 4].view(np.float32).reshape(N, pc)[:, H * HD:]
    assert np.isneginf(lse[-1, :H]).all() and np.isfinite(lse[:-1, :H]).all()
    merged = lay.zeros((N, H * HD))
    check(kvdev, lay, "attn_merge", {"a": ("a", parts["dense"]), "b": ("a", parts["sparse"]),
                                     "out": ("a", merged), "heads": H, "head_dim": HD, "cols": pc},
          N, 0, [(merged, N * H * HD * 4)], clk=clk, kv=kv)
    want, _ = _run_paged(kvdev, lay, {**args, "out": ("a", whole)}, N, q, whole, True)
    got = arena[merged: merged + N * H * HD * 4].view(np.float32).reshape(N, H * HD)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("lengths", [[20, 3, 33, 1], [21]], ids=["gemm", "gemv"])
def test_paged_rope_and_v_projection_write_each_row_at_its_kv_row(kvdev, lay, rng, lengths):
    arena, clk, kv = kvdev
    kvt = KV_NUMPY[kv]
    b = np.dtype(kvt).itemsize
    n_blocks, cols, N = 12, KVH * HD, len(lengths)
    pos, rows_, seq, btab, phys, MB = paged_meta(lay, rng, lengths, n_blocks)
    cache = lay.zeros((n_blocks * BR, cols), kvt)
    x = rows(lay, rng, N, cols)
    rowbytes = [(cache + int(p[-1]) * cols * b, cols * b) for p in phys]
    check(kvdev, lay, "rope", {"x": ("a", x), "out": ("kv", cache), "pos": pos, "rows": rows_,
                               "heads": KVH, "head_dim": HD, "theta": 100000.0}, N, 0, rowbytes,
          clk=clk, atol=40 * 1.2e-7, kv=kv, out_kv=True)
    xn, w = rows(lay, rng, N, D), lay.w4(cols, D, rng)
    vcache = lay.zeros((n_blocks * BR, cols), kvt)
    check(kvdev, lay, "linear", {"x": ("a", xn), "w": w, "out": ("kv", vcache), "rows": rows_,
                                 "K": D, "M": cols}, N, 0,
          [(vcache + int(p[-1]) * cols * b, cols * b) for p in phys], clk=clk, kv=kv, out_kv=True)


def test_an_f16_kv_cache_is_written_through_row_maps_only(dev16, lay, rng):
    """Contiguous KV writes at pos0 (one-shot programs) are f32 only: an f16 pool refuses them
    instead of writing f32 rows into f16 ones."""
    arena, clk, kv = dev16
    x, w, cache = rows(lay, rng, 1, D), lay.w4(KVH * HD, D, rng), lay.zeros((4, KVH * HD))
    args = {"x": ("a", x), "w": w, "out": ("kv", cache), "K": D, "M": KVH * HD}
    for k in (clk, NumpyKernels(arena, kv)):
        with pytest.raises(ValueError, match="row maps only"):
            k.run("linear", args, 1, 2)


@pytest.mark.parametrize("Vs", [1000, 999])         # odd: the AVX-512 form's last pair is one row
@pytest.mark.parametrize("N", [1, 3, 5, 9])
def test_lm_head_rows_gives_every_rows_logits(dev, lay, rng, N, Vs):
    x, table, out = rows(lay, rng, N, D), lay.w8(Vs, D, rng), lay.zeros((N, Vs))
    check(dev, lay, "lm_head", {"x": ("a", x), "table": table, "out": ("a", out), "D": D, "V": Vs,
                                "all_rows": True}, N, 0, [(out, N * Vs * 4)])


@pytest.mark.parametrize("N,bits,tol", [(2, 16, 2e-4), (5, 16, 2e-4), (9, 16, 2e-4), (2, 8, 3e-2)])
def test_batch_linear_in_integers_matches_numpy(dev, lay, rng, N, bits, tol):
    """A decode batch's linear at q16 / q8: its rows prepared once (prep_rows), each weight
    block multiplied in integers with every row (linear_rows_act); written at paged KV rows."""
    arena, clk = dev
    K, M = D, KVH * HD
    x, w = rows(lay, rng, N, K), lay.w4(M, K, rng)
    kv_rows = rng.permutation(40)[:N].astype(np.int32)
    out, rmap = lay.zeros((40, M)), lay.put(kv_rows)
    scratch = lay.zeros(N * 4 * K)
    args = {"x": ("a", x), "w": w, "out": ("kv", out), "rows": ("a", rmap), "K": K, "M": M}
    ref = arena[:lay.top].copy()
    NumpyKernels(ref).run("linear", args, N, 0)
    clk.rows_act, clk._prepared = (scratch, N * 4 * K, bits), None
    try:
        clk._linear_rows(args, N, out, M, rmap)       # any N (the engine uses it up to INT_ROWS_MAX)
        clk.finish()
    finally:
        clk.rows_act = None
    got = arena[out: out + 40 * M * 4].view(np.float32).reshape(40, M)[kv_rows]
    want = ref[out: out + 40 * M * 4].view(np.float32).reshape(40, M)[kv_rows]
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
    untouched = np.setdiff1d(np.arange(40), kv_rows)
    assert not arena[out: out + 40 * M * 4].view(np.float32).reshape(40, M)[untouched].any()


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("bits,wide", [(8, False), (8, True), (16, False)])
@pytest.mark.parametrize("N,K,M", _some([(2, D, KVH * HD), (5, D, F), (9, D, F), (13, F, D), (16, F, D),
                                         (19, D, KVH * HD), (3, D, 40)], slow=[(5, D, F), (13, F, D)]))
def test_batch_linear_tiles_compute_the_integer_reference(dev, lay, rng, build, N, K, M, bits,
                                                          wide, kv):
    """A decode batch's linear at q8 / q16 in weight tiles of 8 rows (cl/batch.cl), or at q8 of
    16 rows where the device has AVX512-VNNI (linear_tile16; M = 40, not a multiple of 16, keeps
    tiles of 8): each row equals the int8 / int16 reference of linear_act (the same prepared row,
    f64 sums) to f32 rounding (f16: that rounded to nearest even), at its paged KV row; rows
    padded to whole tiles (19 rows: 16 + 3; at q16 on a CPU 9 rows in a tile of 12, 13 in one
    of 16) are computed, never stored."""
    arena, clk = dev[0], build
    if kv == "f16" or not wide:
        clk = CLKernels(clk.ctx, clk.queue, clk.buf, clk.options, kv_dtype=kv, mirror=clk.mirror)
        clk.tile16 = wide
    kvt = KV_NUMPY[kv]
    x = rng.standard_normal((N, K)).astype(np.float32)
    x[N // 2, QK: 2 * QK] = 0.0                     # an all-zero block: dx = 0
    x[-1, :QK] *= 1e3                               # blocks of very different scales
    w = lay.w4(M, K, rng)
    kv_rows = rng.permutation(40)[:N].astype(np.int32)
    xo, out, rmap = lay.put(x), lay.zeros((40, M), kvt), lay.put(kv_rows)
    scratch, nbytes = lay.top, 32 * (bits // 8 * K + K // 4 + 64)
    lay.zeros(nbytes // 4)
    qs, d, m = (arena[o: o + n].view(t).reshape(M, -1) for o, n, t in
                [(w[1], M * K // 2, np.uint8), (w[2], M * K // 16, np.float16),
                 (w[3], M * K // 16, np.float16)])
    want = np.stack([linear_act_reference(x[n], qs, d, m, K, M, bits) for n in range(N)])
    clk.rows_act, clk._prepared = (scratch, nbytes, bits), None
    try:
        clk.run("linear", {"x": ("a", xo), "w": w, "out": ("kv", out), "rows": ("a", rmap),
                           "K": K, "M": M}, N, 0)
        clk.finish()
    finally:
        clk.rows_act = None
    got = arena[out: out + 40 * M * kvt(0).itemsize].view(kvt).reshape(40, M)
    if kv == "f16":
        want = want.astype(np.float16).astype(np.float32)
    for n in range(N):          # each row to its own scale (the last one's is ~1e3 times larger)
        np.testing.assert_allclose(got[kv_rows[n]].astype(np.float32), want[n],
                                   rtol=1e-3 if kv == "f16" else 0, atol=1e-5 * np.abs(want[n]).max())
    assert not got[np.setdiff1d(np.arange(40), kv_rows)].any()


@pytest.mark.parametrize("N", _some([2, 3, 5, 8, 12, 16], slow=[2, 5, 12]))
@pytest.mark.parametrize("K,M", MODEL_LINEARS)
def test_q16_tiles_equal_the_int16_rows_kernel(dev, lay, rng, build, N, K, M):
    """A decode batch's linear at q16 (speculative decoding's verification rows): the weight
    tiles (cl/batch.cl, ACT_BITS 16) take the same prepared rows and form the same integer
    products as linear_rows_act, the int16 kernel that ran these batches before; only f32 sums
    run in another order. A wrong pairing of weights and activations is off by the output's
    own scale."""
    arena, clk = dev[0], build
    x = rng.standard_normal((N, K)).astype(np.float32)
    x[0, :QK] *= 300.0                               # blocks of different scales
    x[-1, QK: 2 * QK] = 0.0                          # an all-zero block: dx = 0
    w = lay.w4(M, K, rng)
    xo, tiles, rows_ = lay.put(x), lay.zeros((N, M)), lay.zeros((N, M))
    nbytes = N * (2 * K + K // 4 + 64)               # N int16 rows: what the pool sizes for N
    scratch = lay.zeros(nbytes // 4)
    args = {"x": ("a", xo), "w": w, "out": ("a", tiles), "K": K, "M": M}
    clk.rows_act, clk._prepared = (scratch, nbytes, 16), None
    try:
        assert clk._tile_rows(K, N) is not None      # tiles serve these rows
        clk.run("linear", args, N, 0)
        clk._prepared = None
        clk._linear_rows({**args, "out": ("a", rows_)}, N, rows_, M, 0)
        clk.finish()
    finally:
        clk.rows_act = None
    got, want = (arena[o: o + N * M * 4].view(np.float32).reshape(N, M) for o in (tiles, rows_))
    for n in range(N):
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=2e-6 * np.abs(want[n]).max())


@pytest.mark.parametrize("N", _some([1, 2, 3, 5, 8, 12, 16, 19], slow=[2, 5, 12, 16]))
@pytest.mark.parametrize("Vs", [1000, 1001])        # 1001: not a multiple of 8, lm_head_rows serves
@pytest.mark.parametrize("bits", [16, 8])
def test_lm_head_tiles_compute_the_integer_reference(dev, lay, rng, build, N, Vs, bits):
    """A decode batch's LM head at q16 / q8 on x86 (cl/batch.cl lm_head_tile): every row's
    logits from its int16 / int8 row in its own order and the Q8_0 table's codes, as a one-row
    step's lm_head_act forms them (sum_b d_w dx sum(q_w q_x)), to f32 rounding; rows padded to
    whole tiles (19: 16 + 3) computed, never stored. Elsewhere (another build, V % 8) the f32
    kernel, within the rounding of x."""
    _lm_tile_check(dev[0], lay, rng, build, N, Vs, bits)


def _builds_avx512bw(ctx) -> bool:
    """Whether this OpenCL device's compiler targets AVX512BW (PoCL names the host CPU; on a Zen 4
    LLVM 14 names it znver3, AVX2 only): DOT16_FORM 1's pmaddwd512 builds only there."""
    import pyopencl as cl
    try:
        cl.Program(ctx, "#ifndef __AVX512BW__\n#error no AVX512BW\n#endif\n"
                        "__kernel void k(__global int *a) { a[0] = 1; }").build()
        return True
    except cl.RuntimeError:
        return False


def _form_builds(ctx, form):
    if form == 1 and not _builds_avx512bw(ctx):
        pytest.skip("DOT16_FORM 1 is AVX512BW's pmaddwd512; this device's compiler targets no AVX-512")


@pytest.mark.parametrize("form", [0, 1])
@pytest.mark.parametrize("bits", [16, 8])
def test_lm_head_tiles_narrower_dot_forms(dev, lay, rng, form, bits):
    """lm_head_tile's products without AVX512-VNNI (DOT16_FORM 1: AVX512BW, 0: AVX2), built here
    on purpose."""
    _form_builds(dev[1].ctx, form)
    clk = CLKernels(dev[1].ctx, dev[1].queue, dev[1].buf, f"-DDOT16_FORM={form}", mirror=dev[1].mirror)
    assert _lm_tile_check(dev[0], lay, rng, clk, 5, 1000, bits)       # the tiles ran


def _lm_tile_check(arena, lay, rng, clk, N, Vs, bits) -> bool:
    """lm_head of N rows through clk against the integer reference; -> whether the tiles ran."""
    x = rng.standard_normal((N, D)).astype(np.float32)
    x[0, :QK] *= 300.0                               # blocks of different scales
    x[-1, QK: 2 * QK] = 0.0                          # an all-zero block: dx = 0
    table = lay.w8(Vs, D, rng)
    xo, out = lay.put(x), lay.zeros((N + 1) * Vs)
    row_bytes = prepared_row_bytes(bits, D)
    nbytes = -(-N // 16) * 16 * row_bytes
    scratch = lay.zeros(nbytes // 4)
    qw = arena[table[1]: table[1] + Vs * D].view(np.int8).reshape(Vs, D // QK, QK).astype(np.float64)
    dw = arena[table[2]: table[2] + Vs * D // 16].view(np.float16).reshape(Vs, D // QK).astype(np.float64)
    xb = x.reshape(N, D // QK, QK)
    dx = np.abs(xb).max(axis=2) / np.float32(32767 if bits == 16 else 127)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    qx = np.trunc(xb * inv[:, :, None] + np.copysign(np.float32(0.5), xb))
    want = np.einsum("vbj,nbj,vb,nb->nv", qw, qx.astype(np.float64), dw, dx.astype(np.float64))
    clk.rows_act, clk._prepared = (scratch, nbytes, bits), None
    try:
        clk.run("lm_head", {"x": ("a", xo), "table": table, "out": ("a", out), "D": D, "V": Vs,
                            "all_rows": True}, N, 0)
        clk.finish()
    finally:
        clk.rows_act = None
    got = arena[out: out + (N + 1) * Vs * 4].view(np.float32).reshape(N + 1, Vs)
    tiles = "lm_head_tile_n4" in clk._kernels(64, bits, None, f"-DTILE_K={D} -DTILE_ROW_BYTES="
                                              f"{row_bytes} -DTILE_ALL_N") and Vs % 8 == 0
    for n in range(N):
        np.testing.assert_allclose(got[n], want[n], rtol=0, atol=(2e-6 if tiles else 1e-4 if bits == 16
                                                                  else 3e-2) * np.abs(want[n]).max())
    assert not got[N].any()
    return tiles


@pytest.mark.parametrize("form", [0, 1])
def test_q16_tiles_narrower_dot_forms_compute_the_int16_reference(dev, lay, rng, form):
    """The int16 tile's products without AVX512-VNNI (cl/batch.cl DOT16_FORM): pmaddwd over 512
    bits (AVX512BW), or over two 256-bit halves (AVX2, as on Zen 3), built here on purpose."""
    arena, clk = dev
    _form_builds(clk.ctx, form)
    clk = CLKernels(clk.ctx, clk.queue, clk.buf, f"-DDOT16_FORM={form}", mirror=clk.mirror)
    N, K, M = 5, F, D
    x = rng.standard_normal((N, K)).astype(np.float32)
    w = lay.w4(M, K, rng)
    xo, out = lay.put(x), lay.zeros((N, M))
    nbytes = N * (2 * K + K // 4 + 64)
    scratch = lay.zeros(nbytes // 4)
    qs, d, m = (arena[o: o + n].view(t).reshape(M, -1) for o, n, t in
                [(w[1], M * K // 2, np.uint8), (w[2], M * K // 16, np.float16),
                 (w[3], M * K // 16, np.float16)])
    want = np.stack([linear_act_reference(x[n], qs, d, m, K, M, 16) for n in range(N)])
    clk.rows_act, clk._prepared = (scratch, nbytes, 16), None
    try:
        clk.run("linear", {"x": ("a", xo), "w": w, "out": ("a", out), "K": K, "M": M}, N, 0)
        clk.finish()
    finally:
        clk.rows_act = None
    got = arena[out: out + N * M * 4].view(np.float32).reshape(N, M)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


# -- weights in the other block formats (models/quant.py): one program per format ---------------
WQ = [f for f in FORMATS if f not in ("Q4_0", "Q4_1")]      # the two 4-bit f16 ones are "w4"


@pytest.mark.parametrize("fmt", WQ + ["F16", "BF16", "F32"])
@pytest.mark.parametrize("N", [1, 33])
def test_linear_in_every_format_matches_numpy(dev, lay, rng, fmt, N):
    K, M = 512, 40
    x, out = rows(lay, rng, N, K), lay.zeros((N, M))
    if fmt in WQ:
        w = lay.wq(fmt, M, K, rng)
    else:                               # a float matrix as in the file ("wt")
        v = rng.standard_normal((M, K)).astype(np.float32) * 0.1
        w = ("wt", fmt, lay.put(blocks(fmt, v, rng).view({"F32": np.float32}.get(fmt, np.uint16))))
    check(dev, lay, "linear", {"x": ("a", x), "w": w, "out": ("a", out), "K": K, "M": M},
          N, 0, [(out, N * M * 4)])


@pytest.mark.parametrize("fmt", WQ)
@pytest.mark.parametrize("precision,tol", [("f32", RTOL), ("q16", 1e-4), ("q8", 2e-2)])
def test_fused_decode_linear_in_every_format_is_as_close_as_its_bits(dev, lay, rng, fmt, precision, tol):
    K, M = 512, 38
    x, w, out, out32 = rows(lay, rng, 1, K), lay.wq(fmt, M, K, rng), lay.zeros(M), lay.zeros(M)
    dev[1].run("linear", {"x": ("a", x), "w": w, "out": ("a", out32), "K": K, "M": M}, 1, 0)
    linear_act(dev[1], precision, ("a", x), w, ("a", out), K, M)
    got, want = (dev[0][o: o + 4 * M].view(np.float32) for o in (out, out32))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * float(np.abs(want).max()))


@pytest.mark.parametrize("fmt", WQ)
@pytest.mark.parametrize("bits,tol", [(16, 2e-4), (8, 3e-2)])
def test_batch_linear_in_every_format_matches_numpy(dev, lay, rng, fmt, bits, tol):
    """A decode batch's linear in integers (linear_rows_act; tiles are Q4_1's only)."""
    arena, clk = dev
    N, K, M = 5, 512, 40
    x, w = rows(lay, rng, N, K), lay.wq(fmt, M, K, rng)
    out, scratch = lay.zeros((N, M)), lay.zeros(N * 4 * K)
    args = {"x": ("a", x), "w": w, "out": ("a", out), "K": K, "M": M}
    ref = arena[:lay.top].copy()
    NumpyKernels(ref).run("linear", args, N, 0)
    clk.rows_act, clk._prepared = (scratch, N * 4 * K, bits), None
    try:
        clk.run("linear", args, N, 0)
        clk.finish()
    finally:
        clk.rows_act = None
    got, want = (a[out: out + N * M * 4].view(np.float32) for a in (arena, ref))
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["Q6_K", "Q5_0", "Q4_1"])
def test_embedding_and_lm_head_tables_in_a_block_format_match_numpy(dev, lay, rng, fmt):
    Vs, Dm, N = 300, 256, 3
    table = lay.w4(Vs, Dm, rng) if fmt == "Q4_1" else lay.wq(fmt, Vs, Dm, rng)
    ids, out = lay.put(np.array([299, 0, 17], np.int32)), lay.zeros((N, Dm))
    for scale in (1.0, 16.0):
        check(dev, lay, "embed", {"ids": ("a", ids), "table": table, "out": ("a", out), "V": Vs,
                                  "D": Dm, "scale": scale}, N, 0, [(out, N * Dm * 4)])
    x, logits = rows(lay, rng, N, Dm), lay.zeros((N, Vs))
    for all_rows in (False, True):
        check(dev, lay, "lm_head", {"x": ("a", x), "table": table, "out": ("a", logits), "D": Dm,
                                    "V": Vs, "all_rows": all_rows}, N, 0,
              [(logits, (N if all_rows else 1) * Vs * 4)])


# -- model families (graph/build.py): Qwen2's biases and NEOX rope, Llama 3.1's rope_freqs ------
@pytest.mark.parametrize("N", [1, 33])
def test_linear_with_a_bias_matches_numpy(dev, lay, rng, N):
    K, M = D, KVH * HD
    x, w, out = rows(lay, rng, N, K), lay.w4(M, K, rng), lay.zeros((N, M))
    b = lay.put(rng.standard_normal(M).astype(np.float32))
    check(dev, lay, "linear", {"x": ("a", x), "w": w, "b": ("wf", b), "out": ("a", out), "K": K, "M": M},
          N, 0, [(out, N * M * 4)])


@pytest.mark.parametrize("neox,freqs", [(1, False), (0, True), (1, True)])
def test_rope_variants_match_numpy(dev, lay, rng, neox, freqs):
    N, pos0 = 7, 29
    x, out = rows(lay, rng, N, H * HD), lay.zeros((N, H * HD))
    extra = {"neox": neox} if neox else {}
    if freqs:
        extra["f"] = ("wf", lay.put(np.linspace(1, 8, HD // 2).astype(np.float32)))
    check(dev, lay, "rope", {"x": ("a", x), "out": ("a", out), "heads": H, "head_dim": HD,
                             "theta": 10000.0, **extra}, N, pos0, [(out, N * H * HD * 4)], atol=40 * 1.2e-7)



# -- mixture of experts ------------------------------------------------------------------------
@pytest.mark.parametrize("bits,rtol", [(32, RTOL), (16, 1e-3), (8, 5e-2)])
@pytest.mark.parametrize("N,per_slot,res,fmt", [(1, 0, False, "Q4_1"), (3, 0, False, "Q4_1"),
                                                (1, 1, True, "Q4_1"), (3, 1, False, "Q4_1"),
                                                (3, 0, False, "Q8_0"), (3, 1, True, "Q8_0")])
def test_moe_linear_over_prepared_rows_matches_numpy(dev, lay, rng, bits, rtol, N, per_slot, res, fmt):
    """moe_linear with a scratch (a decode step's few rows): its rows prepared (f32, int16, int8)
    and multiplied as the dense GEMVs are, each row's k experts taken from its route, summed by
    their weights in rank order (down, + a residual; Q4_1 on a CPU: moe_down_q4, other formats
    moe_linear_act; a batch's rows at q16 / q8 by expert in weight tiles: moe_tile); only the
    output and the scratch change."""
    arena, clk = dev
    E, k, K, M = 8, 3, (64 if per_slot else 256), (256 if per_slot else 64)
    route = np.zeros((N, 2 * k + 1), np.float32)
    for n in range(N):
        route[n, :k] = rng.permutation(E)[:k]
        route[n, k:2 * k] = rng.dirichlet(np.ones(k))
    x = rows(lay, rng, N, K * (k if per_slot else 1))
    r = lay.put(route)
    w = lay.w4(E * M, K, rng) if fmt == "Q4_1" else lay.wq(fmt, E * M, K, rng)
    out_n = N * (M if per_slot else k * M)
    out, scratch = lay.zeros(out_n), lay.zeros(64 << 10, np.uint8)
    args = {"x": ("a", x), "route": ("a", r), "w": w, "out": ("a", out), "K": K, "M": M, "E": E,
            "k": k, "per_slot": per_slot, "combine": per_slot}
    h = rows(lay, rng, N, M) if res else 0
    want = arena[:lay.top + GUARD].copy()
    NumpyKernels(want).run("moe_linear", args, N, 0)
    if res:                 # out = h + the weighted sum (kernels.cl add's operands, in its order)
        args["res"] = ("a", h)
        ref = want[out: out + N * M * 4].view(np.float32)
        ref[:] = want[h: h + N * M * 4].view(np.float32) + ref
    clk.moe_scratch, clk.moe_bits = (scratch, 64 << 10), bits
    # a decode batch's replay at q16 / q8 (rows_act): Q4_1 experts go by expert in weight tiles
    tiles = N > 1 and bits < 32 and fmt == "Q4_1"
    clk.rows_act = (scratch, 64 << 10, bits) if tiles else None
    try:
        clk.run("moe_linear", args, N, 0)
        clk.finish()
    finally:
        clk.moe_scratch, clk.moe_bits, clk._prepared, clk.rows_act = None, 32, None, None
    got = arena[:lay.top + GUARD]
    if tiles:               # moe_sort's table: each expert's pairs, every pair once
        assert int(got[scratch: scratch + 4 * E].view(np.int32).sum()) == N * k
    g, ref = (a[out: out + out_n * 4].view(np.float32) for a in (got, want))
    np.testing.assert_allclose(g, ref, rtol=rtol, atol=rtol * float(np.abs(ref).max()))
    keep = np.ones(len(got), bool)
    keep[out: out + out_n * 4] = keep[scratch: scratch + (64 << 10)] = False
    assert np.array_equal(got[keep], want[:len(got)][keep]), "bytes outside the output and scratch changed"
