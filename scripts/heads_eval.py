"""Draft heads' chains on recorded text: for every row of the answers in a data file that
scripts/train_heads.py wrote (--data: the model's own greedy answers and each row's f32 hidden
state), the heads draft a chain of K tokens after the row's next one (Hydra's heads seeing that
next token), and the chain is accepted up to its first miss, as greedy verification accepts it.

    python -m socllm.scripts.heads_eval --data heads-data.npz HEADS.npz [HEADS.npz ...] \
        [--all] [--json F]

Without --all only the conversations train_heads holds out (its seed, 10 %) are read; --all reads
every one (a data file of prompts the heads never saw, e.g. spec_bench's open prompts)."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def chains(heads, seqs: list, hs: list) -> np.ndarray:
    """Tokens accepted per row (0 .. K) over every answer row of `seqs`."""
    out = []
    for (prompt, ans), h in zip(seqs, hs):
        ids = np.asarray(list(prompt) + list(ans))
        t = np.arange(max(0, len(prompt) - 1), len(ids) - heads.k - 1)
        if not len(t):
            continue
        d = heads.propose(h[t], 1, ids[t + 1])
        ok, n = np.ones(len(t), bool), np.zeros(len(t))
        for k in range(heads.k):
            ok &= d[:, k] == ids[t + k + 2]
            n += ok
        out.append(n)
    return np.concatenate(out)


def main(argv=None) -> int:
    from socllm.models.gguf_file import model_path
    from socllm.models.heads import embedding_rows
    from socllm.policies.drafting import Heads
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("heads", nargs="+", help="heads files (.npz, models/heads.py's format)")
    ap.add_argument("--data", required=True, help="train_heads --data's file")
    ap.add_argument("--all", action="store_true", help="every conversation, not the held-out ones")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    z = np.load(a.data, allow_pickle=True)
    seqs, hs = list(map(tuple, z["seqs"])), list(z["hs"])
    if not a.all:                                   # train_heads.train's held-out conversations
        order = np.random.default_rng(0).permutation(len(seqs))
        held = sorted(order[:max(1, len(seqs) // 10)].tolist())
        seqs, hs = [seqs[i] for i in held], [hs[i] for i in held]
    rows = []
    for path in a.heads:
        f = np.load(path)
        vocab = f["vocab"].astype(np.int64)
        heads = Heads(f["W"].astype(np.float32), f["b"].astype(np.float32), vocab,
                      embedding_rows(model_path(a.model), vocab),
                      A=f["A"].astype(np.float32) if "A" in f.files else None)
        n = chains(heads, seqs, hs)
        row = {"heads": path, "hydra": "A" in f.files, "rows": int(len(n)),
               "accepted_mean": round(float(n.mean()), 4),
               "at_least": [round(float((n >= k).mean()), 4) for k in range(1, heads.k + 1)]}
        rows.append(row)
        print(f"{path}: {row['rows']} rows, {row['accepted_mean']:.3f} of {heads.k} accepted a "
              f"chain; at least 1..{heads.k}: {row['at_least']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"data": a.data, "all": a.all, "conversations": len(seqs), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
