"""Static shape buckets (NPU rules, DESIGN.md §1): prefill chunks of 32 ... 1024 rows, decode 1."""
from __future__ import annotations

PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024)
DECODE_BUCKET = 1
MAX_CHUNK = PREFILL_BUCKETS[-1]


def bucket_for(n: int) -> int:
    """Smallest prefill bucket holding n rows."""
    for b in PREFILL_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"chunk of {n} rows exceeds the largest bucket {MAX_CHUNK}")


def prefill_chunks(n_tokens: int) -> list:
    """Split a prompt into (rows, bucket) chunks: full 1024-row chunks, then the smallest bucket
    that holds the rest (padding stays below half the bucket)."""
    chunks = []
    left = n_tokens
    while left > 0:
        rows = min(left, MAX_CHUNK)
        chunks.append((rows, bucket_for(rows)))
        left -= rows
    return chunks
