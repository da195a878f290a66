"""KV cache ownership: the pool's KV region belongs to one generation at a time.

The cache is written in place by the kernels (rows pos0 .. pos0+N of each layer's K and V,
Transformer-Lite §2.3); nothing is copied between steps. A generation acquires it and releases
it when it ends, normally or not. One sequence per pool for now: the serving issue adds more
sequences (one KV block per request) and continuous batching.
"""
from __future__ import annotations

import threading


class KVCache:
    def __init__(self, rows: int, n_layers: int, cols: int):
        self.rows, self.n_layers, self.cols = rows, n_layers, cols  # each layer: K, V [rows, cols] f32
        self.owner = None
        self._lock = threading.Lock()

    def acquire(self, request_id, timeout: float = 600.0):
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError("the KV cache stayed busy")
        self.owner = request_id
        return self

    def release(self):
        self.owner = None
        self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
