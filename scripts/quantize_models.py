"""SmolLM2 in the formats people download, written by llama.cpp's own quantizer (the `bench`
extra's llama-cpp-python), for `socllm bench --model FILE` and the format checks.

    python -m socllm.scripts.quantize_models [--out DIR] [--types Q4_K_M,Q6_K,Q8_0,F16]

The source is the default model (Q4_1), requantized (llama.cpp's --allow-requantize): the files
hold exactly the tensor types a Q4_K_M / Q6_K / Q8_0 / F16 file of SmolLM2 holds (rows of 576
weights fall back from the K-quants to Q5_0 / Q5_1 / Q8_0, as llama.cpp decides), though their
weights carry the Q4_1 source's rounding too.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from socllm.models.gguf_file import default_model_path

OUT = Path.home() / ".cache" / "socllm" / "models"
TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "F16")


def quantize(src: str, dst: str, kind: str, threads: int = 2) -> str:
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    params.nthread = threads
    tmp = dst + ".part"
    if llama_cpp.llama_model_quantize(src.encode(), tmp.encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {kind}")
    os.replace(tmp, dst)
    return dst


def model_file(kind: str, out: Path = OUT) -> str:
    """The SmolLM2 file of this type, written on first use."""
    out.mkdir(parents=True, exist_ok=True)
    dst = out / f"SmolLM2-135M-Instruct.{kind}.gguf"
    if not dst.exists():
        quantize(default_model_path(), str(dst), kind)
    return str(dst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--types", default=",".join(TYPES))
    a = ap.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("quantize_models: needs llama-cpp-python (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    for kind in a.types.split(","):
        print(model_file(kind, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
