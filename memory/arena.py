"""The unified pool's backing store: one POSIX shared-memory segment per engine, attached by
every actor by name (HeteroLLM §4.2: the pool is reserved once and never reclaimed while the
engine lives, so host/device mappings stay valid).

Segments are named `socllm-<creator pid>-<token>` under /dev/shm. The creator unlinks its segment
on close, at interpreter exit and on SIGTERM; `reap_orphans()` unlinks segments whose creator
process is gone (a SIGKILLed engine), so nothing outlives socllm for long.
"""
from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import re
import secrets

import numpy as np

_libc = ctypes.CDLL(None, use_errno=True)

SHM_DIR = "/dev/shm"
PREFIX = "socllm-"
ALIGN = 4096


def align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


class Arena:
    """A named shared-memory segment mapped into this process as one flat uint8 array `buf`.

    The first `readonly_bytes` (a page multiple) are the weight region: the creator writes them
    once; every attacher maps them read-only (mprotect), so no actor can scribble on weights."""

    def __init__(self, name: str, size: int, owner: bool, mm: mmap.mmap, readonly_bytes: int):
        self.name, self.size, self.owner = name, size, owner
        self.readonly_bytes = readonly_bytes
        self._mm = mm
        self.buf = np.frombuffer(mm, np.uint8)   # [size] the whole arena
        self.address = self.buf.ctypes.data

    @classmethod
    def create(cls, size: int, readonly_bytes: int = 0) -> "Arena":
        reap_orphans()
        size = align(size, ALIGN)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arena = cls(name, size, True, mm, readonly_bytes)
        atexit.register(arena.unlink)
        return arena

    @classmethod
    def attach(cls, name: str, size: int, readonly_bytes: int = 0) -> "Arena":
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arena = cls(name, size, False, mm, readonly_bytes)
        if readonly_bytes:
            arena.protect_weights()
        return arena

    def protect_weights(self):
        """Map the weight region read-only in this process (after it was written)."""
        if _libc.mprotect(ctypes.c_void_p(self.address), ctypes.c_size_t(self.readonly_bytes),
                          mmap.PROT_READ) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of the weight region failed")

    def release(self, ranges: list):
        """Give these pages back to the OS ([(offset, bytes)], page-aligned): every process that
        maps the segment reads zeros there until one writes them again (MADV_REMOVE punches the
        hole in the shared memory itself, not only in this mapping)."""
        for off, n in ranges:
            self._mm.madvise(mmap.MADV_REMOVE, off, n)

    def unlink(self):
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def reap_orphans() -> list[str]:
    """Unlink socllm segments whose creator process no longer exists. A segment this user may
    not unlink (another user's, in the sticky /dev/shm) is skipped: it is theirs to reap, and
    it must not stop this user's engine from starting."""
    gone = []
    for entry in os.listdir(SHM_DIR):
        m = re.fullmatch(rf"{PREFIX}(\d+)-[0-9a-f]+", entry)
        if m and not _alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, entry))
                gone.append(entry)
            except (FileNotFoundError, PermissionError):
                pass
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def strided_rows(arena: np.ndarray, off: int, rows: int, cols: int, ld: int, dtype) -> np.ndarray:
    """A writable [rows, cols] view at byte off whose rows start ld elements apart (ld > cols: a
    row-cut half's columns of the whole output); it ends at its last element."""
    size = np.dtype(dtype).itemsize
    if ld == cols or rows == 1:
        return arena[off: off + rows * cols * size].view(dtype).reshape(rows, cols)
    span = arena[off: off + ((rows - 1) * ld + cols) * size].view(dtype)
    return np.lib.stride_tricks.as_strided(span, (rows, cols), (ld * size, size), writeable=True)
