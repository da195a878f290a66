"""Compiled step programs kept on disk between runs: one folder per code, model file, pool layout
and row-cut profile (cache_dir/programs/<digest>/), one file per program key. A later engine of the
same code reads its programs here instead of starting the planner actor (a process, sympy, the
model's graph: most of a second of a small device's start). The digest covers the source of
every layer that decides a program's bytes (graph/, models/, memory/, policies/), so programs of
other code are never read; a file cut short or damaged is compiled again."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import msgpack

KEEP = 64        # folders kept (each code change, model and layout has its own: ~100 KB each)
_digests: dict = {}


def code_version(pkgs=("graph", "models", "memory", "policies"), exts=(".py",)) -> str:
    """A digest of the source under these folders of the project (by default the code that
    compiles step programs; the service's plan cache names the processors' kernels too)."""
    key = (tuple(pkgs), tuple(exts))
    if key not in _digests:
        h = hashlib.sha256()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for pkg in pkgs:
            for dirpath, dirs, files in sorted(os.walk(os.path.join(root, pkg))):
                dirs.sort()
                for name in sorted(f for f in files if f.endswith(exts)):
                    with open(os.path.join(dirpath, name), "rb") as f:
                        h.update(name.encode() + b"\0" + f.read())
        _digests[key] = h.hexdigest()
    return _digests[key]


class ProgramStore:
    def __init__(self, cache_dir: str, model_digest: str, n_layers: int | None, layout: dict,
                 rowcut_profile: dict | None):
        """model_digest: the model file's sha256 (models/gguf_file.py file_digest: the same
        model installed elsewhere finds its programs); layout: memory/layout.py
        PoolLayout.to_dict() of the pool the programs address; rowcut_profile: how the tensor plan
        cuts the linears (an hcmp program's share is in its key)."""
        what = json.dumps([code_version(), model_digest, n_layers, layout, rowcut_profile],
                          sort_keys=True, default=str)
        self.root = os.path.join(cache_dir, "programs")
        self.folder = os.path.join(self.root, hashlib.sha256(what.encode()).hexdigest()[:32])

    def known(self) -> bool:
        """Whether an earlier engine kept programs for this code, model and layout."""
        return os.path.isdir(self.folder)

    def path(self, key: tuple) -> str:
        plan, all_rows, buffer, bucket = key
        return os.path.join(self.folder, f"{plan}-{'batch' if all_rows else 'chunk'}-{buffer}-{bucket}.msgpack")

    def get(self, key: tuple) -> tuple | None:
        """(msgpack bytes, processors) of a program kept for key (policies/planner.py
        paged_program's), or None: not kept, or not whole."""
        try:
            with open(self.path(key), "rb") as f:
                got = msgpack.unpackb(f.read())
        except (OSError, ValueError):
            return None
        ok = isinstance(got, list) and len(got) == 2 and isinstance(got[0], bytes) \
            and isinstance(got[1], list)
        return (got[0], got[1]) if ok else None

    def put(self, key: tuple, blob: bytes, procs: list):
        """Keep a program, whole or not at all (nothing if the cache cannot be written: a
        read-only home compiles again next time)."""
        try:
            if not self.known():
                self._prune()
            os.makedirs(self.folder, exist_ok=True)
            path = self.path(key)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(msgpack.packb([blob, list(procs)]))
            os.replace(tmp, path)
        except OSError:
            pass

    def _prune(self):
        """All but the KEEP - 1 newest folders go, before a new one is made."""
        try:
            folders = sorted((e for e in os.scandir(self.root) if e.is_dir()),
                             key=lambda e: e.stat().st_mtime)
        except OSError:
            return
        for e in folders[:max(0, len(folders) - KEEP + 1)]:
            shutil.rmtree(e.path, ignore_errors=True)
