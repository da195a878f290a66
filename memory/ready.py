"""Ready words: 32-bit counters in the pool that say how far a producer has got.

A producer stores a larger value when its tensor is complete and wakes the waiters; a consumer
waits until the word reaches the value it needs. HeteroLLM §4.2: the one waiter whose input is
imminent sleeps for the predicted time, then polls briefly; every other waiter blocks in the
kernel (a futex on the shared page), so an idle actor burns no core.

Values are stamps `epoch * STEP + seq`: the step's epoch and the position of the task that wrote
the word in the step's global order. They only grow within an epoch cycle, so `>=` is the test.
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

STEP = 4096                 # tasks per step at most (seq < STEP)
MAX_EPOCH = (1 << 32) // STEP - 1

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = 202            # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class ReadyWords:
    """An array of u32 ready words inside the arena: `words[i]` lives at `address + 4*i`."""

    def __init__(self, buf: np.ndarray):
        self.words = buf.view(np.uint32)          # [n_words]
        self.address = self.words.ctypes.data

    def __len__(self):
        return len(self.words)

    def get(self, i: int) -> int:
        return int(self.words[i])

    def store(self, i: int, value: int, wake: bool = True):
        # x86 stores are ordered after the earlier writes of the tensor (TSO); an aligned u32
        # store is atomic, so a reader sees either the old or the new stamp.
        self.words[i] = value
        if wake:
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self.address + 4 * i), _FUTEX_WAKE,
                          0x7FFFFFFF, None, None, 0)

    def wait(self, i: int, value: int, spin_s: float = 20e-6, timeout_s: float | None = None,
             sleep_s: float = 0.0) -> bool:
        """Wait until words[i] >= value. Returns False on timeout.

        sleep_s: predicted time until the producer is done (HeteroLLM §4.2 predicted sleep);
        then poll for spin_s; then block in the kernel (futex) until woken."""
        w = self.words
        if w[i] >= value:
            return True
        if sleep_s > 0:
            time.sleep(sleep_s)
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            if w[i] >= value:
                return True
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        addr = ctypes.c_void_p(self.address + 4 * i)
        ts = _Timespec()
        while True:
            cur = int(w[i])
            if cur >= value:
                return True
            left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if left <= 0:
                return False
            ts.tv_sec, ts.tv_nsec = int(left), int((left - int(left)) * 1e9)
            # sleeps only while the word still holds `cur`; any store+wake ends it
            _libc.syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_uint32(cur), ctypes.byref(ts),
                          None, 0)

    def wait_change(self, i: int, seen: int, timeout_s: float) -> int:
        """Block until words[i] != seen (or the timeout); returns the current value."""
        addr = ctypes.c_void_p(self.address + 4 * i)
        ts = _Timespec(int(timeout_s), int((timeout_s - int(timeout_s)) * 1e9))
        cur = int(self.words[i])
        if cur == seen:
            _libc.syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_uint32(seen), ctypes.byref(ts),
                          None, 0)
            cur = int(self.words[i])
        return cur


class SleepPredictor:
    """HeteroLLM §4.2 predicted sleep, learned: per wait site (a unit of a program, or a step), an
    exponential average of how long the producer took in earlier steps. The waiter sleeps
    `fraction` of that (if it is long enough to be worth a sleep), then polls, then blocks (wait).

    Off by default (fraction 0; the config's sleep_fraction, SOCLLM_SLEEP_FRACTION, sets it): on
    the 2-core dev machine a fraction of 0.8 made hetero prefill 1.4-2.5x slower (512 tokens:
    230-305 vs 417-432 tok/s; npu 128: 144-185 vs 368-375) and left decode unchanged — a futex
    wake costs ~1-2 us here (bench --sync), and a sleeping thread wakes later than a futex waiter
    on busy cores. The paper sleeps because polling a GPU fence burns a core; here the blocking
    wait already burns none."""

    def __init__(self, fraction: float = 0.0, alpha: float = 0.5, min_s: float = 200e-6):
        self.fraction, self.alpha, self.min_s = fraction, alpha, min_s
        self.expected: dict = {}            # site -> seconds

    def sleep_s(self, site) -> float:
        e = self.expected.get(site, 0.0)
        return self.fraction * e if e >= self.min_s else 0.0

    def observe(self, site, waited_s: float):
        e = self.expected.get(site)
        self.expected[site] = waited_s if e is None else e + self.alpha * (waited_s - e)

    def wait(self, words: "ReadyWords", site, i: int, value: int, timeout_s: float | None = None) -> bool:
        """words.wait with the predicted sleep for `site`, learning how long the producer takes.
        A sleep that overshoots (the word was ready when it ended) teaches the sleep's length,
        not the time slept: an oversleep under load must not feed the next prediction."""
        if words.words[i] >= value:
            self.observe(site, 0.0)
            return True
        t0 = time.perf_counter()
        s = self.sleep_s(site)
        if s > 0:
            time.sleep(s)
            if words.words[i] >= value:
                self.observe(site, s)
                return True
        ok = words.wait(i, value, timeout_s=timeout_s)
        self.observe(site, time.perf_counter() - t0)
        return ok
