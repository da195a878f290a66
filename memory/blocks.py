"""Paged KV (Transformer-Lite §2.3, in place; vLLM's block tables): the pool's KV region is fixed-
size blocks of BLOCK_ROWS rows of every layer's K and V. A sequence holds a block table, the ids of
its blocks in order: its row p lives in block table[p // BLOCK_ROWS], row p % BLOCK_ROWS. Blocks
are taken as a sequence grows and given back when it ends; nothing is ever copied between them.

This is the bookkeeping only (no Ray, no kernels): the tables themselves are written into the
pool by the runner each step, where every processor's attention reads them.
"""
from __future__ import annotations

BLOCK_ROWS = 16             # rows of a block (a multiple of 8: the GPU reads keys 8 at a time)


def blocks_for(rows: int, block_rows: int = BLOCK_ROWS) -> int:
    return -(-rows // block_rows)


class BlockPool:
    def __init__(self, n_blocks: int, block_rows: int = BLOCK_ROWS):
        if n_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {n_blocks}")
        self.n_blocks, self.block_rows = n_blocks, block_rows
        # a stack: the blocks freed last are taken first, so the pages a busy service touches stay
        # the few it needs at its peak (a queue would walk through every page of the region)
        self.free: list = list(range(n_blocks))[::-1]

    @property
    def n_free(self) -> int:
        return len(self.free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self.free)

    def need(self, table: list, rows: int) -> int:
        """Blocks a sequence holding `table` must still take to hold `rows` rows."""
        return max(0, blocks_for(rows, self.block_rows) - len(table))

    def can_grow(self, table: list, rows: int) -> bool:
        return self.need(table, rows) <= len(self.free)

    def grow(self, table: list, rows: int):
        """Append blocks to `table` until it holds `rows` rows (RuntimeError if too few are free)."""
        n = self.need(table, rows)
        if n > len(self.free):
            raise RuntimeError(f"{n} KV blocks needed, {len(self.free)} free")
        table.extend(self.free.pop() for _ in range(n))

    def release(self, table: list):
        """Give a sequence's blocks back (it ended, was cancelled or preempted)."""
        self.free.extend(reversed(table))
        table.clear()
