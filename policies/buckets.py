"""Static shape buckets (NPU rules, DESIGN.md §1): prefill chunks of 32 ... 1024 rows, decode 1, and
KV-length buckets of 256 rows for the attention (Transformer-Lite §2.1)."""
from __future__ import annotations

PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024)
DECODE_BUCKET = 1
MAX_CHUNK = PREFILL_BUCKETS[-1]
KV_STEP = 256            # KV rows an NPU attention graph reads come in multiples of this


def bucket_for(n: int) -> int:
    """Smallest prefill bucket holding n rows."""
    for b in PREFILL_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"chunk of {n} rows exceeds the largest bucket {MAX_CHUNK}")


def prefill_chunks(n_tokens: int) -> list:
    """Split a prompt into (rows, bucket) chunks that waste little padding on static graphs: the
    largest bucket that the rest fills, then the smallest bucket holding a short tail
    (600 -> 512 + 64 + 24 rows in a 32-bucket, not 600 rows in a 1024-bucket)."""
    chunks = []
    left = n_tokens
    while left > 0:
        full = [b for b in PREFILL_BUCKETS if b <= left]
        rows = full[-1] if full else left
        chunks.append((rows, bucket_for(rows)))
        left -= rows
    return chunks


def batch_bucket(n: int, max_seqs: int) -> int:
    """The static rows of an NPU decode batch graph that takes n rows: the next power of two, at
    most max_seqs (a decode step's rows)."""
    return min(1 << (n - 1).bit_length(), max_seqs)


def kv_bucket(rows: int, cap: int, step: int = KV_STEP) -> int:
    """KV rows a static attention graph reads: `rows` (the cache rows the step needs) padded up to
    a multiple of `step`, at most `cap` (the cache's capacity); 0 when no row is needed.
    Transformer-Lite §2.1: pad the sequence length so that shapes change only when the real
    length crosses a padding boundary; the attention mask covers the padded rows. So one compiled
    graph serves `step` positions, and attention costs O(pos0 + B), not O(capacity)."""
    if not 0 <= rows <= cap:
        raise ValueError(f"{rows} KV rows do not fit the capacity {cap}")
    return min(-(-rows // step) * step, cap)


def const_weights(phase: str, bucket: int) -> bool:
    """Should the NPU compile weights into its graphs (compressed-FullyConnected constants) or
    read them from the pool as graph inputs (dequantized in the graph at every run)?

    Measured on OpenVINO 2026.4's CPU device (2 cores, AVX2 without VNNI), 40 matmuls [1536, 576]:
    the plugin recognises Q4_1 as u4 Constant -> Convert -> Subtract(zp = -m/d, f32, non-integer
    is accepted) -> Multiply(d, f32) -> Reshape and runs it as a u4 FullyConnected
    (brgemm_avx2_f32), relative error 2e-7; f16 zero points cost 4e-4 error, and w = q*d + m
    (Multiply, Add) is folded to f32 weights, 9 bytes per weight, 2.5x slower. One row: 2.6 ms as
    constants vs 37 ms as inputs (14x); 512 rows: 348 vs 380 ms.

    What constants cost is per compiled graph: each graph keeps its own scratch and repacked
    data, ~4 bytes per weight of the graph when every layer is its own graph (30 per-layer
    prefill graphs at 256 rows: +454 MB), ~1.5 bytes per weight when the whole model is one
    graph. So:
      decode (one row: a one-sequence step, the contiguous "decode" program or the service's
        one-row "batch"): every layer's weights compiled in, a graph from one attention to the
        next. The service's batch programs were left out until 2026-11-27, so `--plan npu`
        decoded from inputs: with constants, 32 tokens of one stream take 1.2-1.4 s against
        4.9-13 s (SmolLM2, f32), 2.1-3.5 s against 12-18 s (Gemma 3 270M), for +160 / +200 MB in
        the NPU actor (2-core Emerald Rapids VM, by hand); batches of more rows keep inputs (one
        compiled copy of the weights per bucket would be ~150 MB each);
      prefill chunks of WHOLE_GRAPH_FROM rows or more that start the prompt (pos0 = 0): the whole
        model as ONE graph (`whole_graph`), with no KV cache to read, so one graph per bucket;
      other prefill chunks: weights as inputs, one per-layer graph shared by all layers.
    `python -m socllm.scripts.profile_prefill --bucket B [--per-layer]`, min of 4, tok/s and the
    process's USS (whole graph / per-layer input graphs):
      256 rows: 657 / 445 tok/s, 711 / 484 MB;  512: 647 / 480, 805 / 519;
      1024: 583 / 430, 1040 / 588 — 1.35-1.48x faster for 227-452 MB more per bucket used
      (SOCLLM_WHOLE_GRAPH=0 turns whole graphs off: policies/config.py)."""
    return phase == "decode" or phase == "batch" and bucket == 1


# q16 / q8 (int16 / int8 activations in the GPU's decode GEMVs) have no OpenVINO hint of their
# own. A dense model's prefill chunks on the NPU (npu_prefill_act, below):
# - q16: bf16, 16-bit activations as an NPU's fp16, where the device computes bf16. Measured on a
#   2-core Zen 5 (avx512_bf16), a 512-row first chunk of the default model: 1,514 -> 2,213 tok/s;
#   over 20 windows of 256 tokens, KL(oracle || last row) 4.8e-4 nats, every top-1 the oracle's.
# - q8: int8 activations, as the GPU's q8 tiles: OpenVINO's dynamic quantization (per 32 columns,
#   NPU_DQ_GROUP) in the whole-model graph, whose Q4_1 weights are split so that it takes them
#   (npu/weights.py linear); the lm-head stays f32. Measured on the 2-core Emerald Rapids VM (no
#   bf16; capabilities FP32, INT8), 512-row first chunk: 696 -> 496 ms against f32; 20 windows of
#   256 tokens: KL 1.57e-3 mean, 4.2e-3 the largest, every top-1 the oracle's (the GPU's q8 chunks
#   1.37e-3, the same run). Not for q16: no one kind of linear holds the error (f32 down
#   projections 1.1e-3, f32 gate and up 9.5e-4), so it stays 3x bf16's.
# Every other graph (decode steps, MoE layers, whose router's top-k a bf16 rounding flips: a logit
# off by 22 % of its scale in a decode batch, measured) stays f32, as f32 does everywhere.
NPU_PREFILL_ACT = {"q8": "i8", "q16": "bf16"}   # precision -> the NPU's prefill activations
NPU_DQ_GROUP = 32          # the columns of one int8 scale ("i8": DYNAMIC_QUANTIZATION_GROUP_SIZE)


def npu_prefill_act(precision: str, capabilities) -> str:
    """OpenVINO's inference precision for a dense prefill chunk at this precision, on a device
    with these OPTIMIZATION_CAPABILITIES ("i8": f32 with dynamic quantization): NPU_PREFILL_ACT's
    i8 where the device computes INT8, else its bf16 where it computes BF16, else f32. A bf16 hint
    elsewhere computes f32 anyway, and slower: on a 2-core Emerald Rapids VM without avx512_bf16
    (capabilities FP32, INT8), the default model's 512-row whole-model graph took 1,926 ms with
    the bf16 hint against 483 with f32 (median of 3, `profile_prefill --bucket 512`)."""
    act = NPU_PREFILL_ACT.get(precision, "f32")
    if act == "i8" and "INT8" not in capabilities:
        act = "bf16"
    return act if act != "bf16" or "BF16" in capabilities else "f32"


# prefill bucket from which a prompt's first chunk runs as one graph. 128 since 2026-11-28
# (`profile_prefill --bucket 128 --precision q16`, 2-core Emerald Rapids VM, bf16 on AMX): whole
# 44 ms against 141 in per-layer graphs (64 rows: 35 ms), so that the service's 128-row chunks
# (prefill_chunk) run there; the price, an idle `serve --plan hetero`'s NPU actor at 730 MB PSS
# against 453 with SOCLLM_WHOLE_GRAPH=0 (scripts/results/pss-2core-emr-stop53-hetero.json).
# 256 before, from a machine without bf16, where the gain was smaller.
WHOLE_GRAPH_FROM = 128


def whole_graph(phase: str, bucket: int) -> bool:
    """Does a prefill chunk of this bucket at pos0 = 0 run as one whole-model NPU graph with its
    weights compiled in (const_weights)? Only the larger buckets: each such graph holds
    227-452 MB of its own. (The
    config's whole_graph, policies/config.py, turns them off.)"""
    return phase in ("prefill", "chunk") and bucket >= WHOLE_GRAPH_FROM
