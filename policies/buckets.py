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


def kv_bucket(rows: int, cap: int, step: int = KV_STEP) -> int:
    """KV rows a static attention graph reads: `rows` (the cache rows the step needs) padded up to
    a multiple of `step`, at most `cap` (the cache's capacity); 0 when no row is needed.
    Transformer-Lite §2.1: pad the sequence length so that shapes change only when the real
    length crosses a padding boundary; the attention mask covers the padded rows. So one compiled
    graph serves `step` positions, and attention costs O(pos0 + B), not O(capacity)."""
    if not 0 <= rows <= cap:
        raise ValueError(f"{rows} KV rows do not fit the capacity {cap}")
    return min(-(-rows // step) * step, cap)


def const_weights(phase: str, bucket: int, prefer_speed: bool = False) -> bool:
    """Should the NPU compile weights into its graphs (compressed-FullyConnected constants) or
    read them from the pool as graph inputs? Measured on OpenVINO 2026.4's CPU device (2 cores,
    AVX2, `python -m socllm.scripts.measure`): constants make the npu plan's decode 3.6x faster
    (39 vs 11 tok/s) but cost ~525 MB for the one decode graph (the plugin repacks ~5 bytes per
    4-bit weight); prefill chunks run about as fast either way (200-209 tok/s at 512). Inputs keep
    the weights only in the pool and let every layer share one compiled graph. socllm keeps the
    memory (its default plan decodes on the GPU); prefer_speed turns constants on for decode."""
    return prefer_speed and phase == "decode"
