"""The running service (`socllm serve`) through the Python client: greedy text of the prompts
against the numpy oracle's (oracle.json from oracle.py), then 1 and 8 concurrent streams of 64
tokens (ignore_eos), REPS times each, aggregate tok/s; the service's status (PSS) at the end.

    python service.py ORACLE.json OUT.json [REPS]
"""
import json
import statistics
import sys
import threading
import time

import socllm

ora = json.load(open(sys.argv[1]))
out_path, reps = sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3
c = socllm.connect()
res = {"greedy": [], "streams": {}}

for d in ora["prompts"]:
    cl = socllm.Client(c.service)
    got = cl.generate(d["prompt"], max_tokens=ora["n"], temperature=0)
    u = cl.last["usage"]
    r = {"prompt": d["prompt"], "text": got, "oracle_text": d["text"], "equal": got == d["text"],
         "usage": u, "finish_reason": cl.last["finish_reason"], "oracle_stop_at": d["stop_at"]}
    res["greedy"].append(r)
    print(f"greedy {d['prompt']!r}: text == oracle {r['equal']} ({u}, finish {r['finish_reason']}, "
          f"oracle stops at {d['stop_at']})\n  {got!r}")


def run(n: int):
    stats = [None] * n

    def one(i):
        cl = socllm.Client(c.service)
        t0 = time.perf_counter(); first = None
        for piece in cl.generate(ora["prompts"][i % 3]["prompt"], max_tokens=64, temperature=0,
                                 ignore_eos=True, stream=True):
            first = first or time.perf_counter()
        stats[i] = (cl.last["usage"], first - t0, time.perf_counter() - t0)

    th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    [t.start() for t in th]; [t.join() for t in th]
    wall = time.perf_counter() - t0
    toks = sum(s[0]["completion_tokens"] for s in stats)
    return {"streams": n, "tokens": toks, "wall_s": round(wall, 4), "tok_s": round(toks / wall, 1),
            "ttft_s": [round(s[1], 4) for s in stats], "stream_s": [round(s[2], 4) for s in stats]}


for n in (1, 8):
    runs = [run(n) for _ in range(reps)]
    ts = [r["tok_s"] for r in runs]
    res["streams"][n] = {"runs": runs, "tok_s_min": min(ts), "tok_s_median": statistics.median(ts),
                         "tok_s_max": max(ts)}
    print(f"{n} streams x 64 tokens, {reps} runs: tok/s {ts} -> min {min(ts)} / median "
          f"{statistics.median(ts)} / max {max(ts)}; ttft (s) {[r['ttft_s'] for r in runs]}")
st = c.status()
res["status"] = st
print("status:", json.dumps({k: st.get(k) for k in ("plan", "precision", "prefill", "decode_step_ms",
                                                       "memory_pss_mb", "memory_pss_mb_by_process", "loop")}))
print("processors:", [(p["processor"], p.get("device")) for p in st.get("processors", [])])
json.dump(res, open(out_path, "w"), indent=1, default=str)
