"""One stream's decode on the npu plan (the service's one-row batches on the NPU's static graphs):
seconds for 32 tokens, three times after a warm-up, and the NPU actor's PSS.

    python -m socllm.scripts.npu_decode [MODEL]      (MODEL: a GGUF or gemma3-270m)
"""
from __future__ import annotations

import sys
import time


def main(argv=None) -> int:
    import psutil

    import socllm
    argv = sys.argv[1:] if argv is None else argv
    model = argv[0] if argv else None
    kw = {"model": model} if model else {}
    with socllm.LLM(precision="f32", context=512, max_seqs=4, kv_mb=16, plan="npu", policy="fcfs",
                    warm=False, speculate="off", **kw) as llm:
        llm.generate(["The capital of France is"], max_tokens=4, ignore_eos=True)
        ts = []
        for _ in range(3):
            t = time.perf_counter()
            out = llm.generate(["The capital of France is"], max_tokens=32, ignore_eos=True)
            ts.append(time.perf_counter() - t)
        pid = next(p["pid"] for p in llm.status()["processors"] if p["processor"] == "npu")
        pss = psutil.Process(pid).memory_full_info().pss / 2**20
    print(f"{model or 'default model'}: 32 tokens in {[round(t, 2) for t in ts]} s, "
          f"npu actor PSS {pss:.0f} MB, text {out[0].text[:50]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
