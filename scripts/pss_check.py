"""PSS of socllm's processes (the service's status) and of Ray's daemons: idle, then under 8 streams
(4 of them constrained by a JSON schema), then idle again after three more waves of 8 (new
prompts, 300 tokens each: what the prefix cache keeps, up to --prefix-cache-mb of KV, stays),
and once more when the service, idle for its --prefix-cache-idle-s, has let the cache go (it
waits for that up to that window and a minute more; --no-release: not at all).

    ray start --head && socllm serve && python scripts/pss_check.py [--no-release]    # one JSON object
"""
import json
import sys
import threading
import time

import psutil

import socllm


def main():
    c = socllm.connect()
    def ray_pss():
        tot = 0
        for p in psutil.process_iter(["name", "cmdline"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if any(k in cmd for k in ("raylet", "gcs_server", "dashboard", "ray::", "log_monitor", "runtime_env", "monitor.py")):
                    tot += p.memory_full_info().pss
            except Exception:
                pass
        return tot / 2**20
    time.sleep(5)
    st = c.status()
    out = {"idle": {"socllm_pss_mb": st["memory_pss_mb"], "by_process": st["memory_pss_mb_by_process"], "ray_and_socllm_pss_mb": round(ray_pss(), 1)}}
    samples = []
    listing = {"type": "json_schema", "json_schema": {"name": "l", "strict": True, "schema": {
        "type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 40, "maxItems": 60}}}

    def stream(i):           # half of them under a JSON schema: the mask library loaded too
        if i % 2:
            c.chat([{"role": "user", "content": f"List animals, set {i}."}], max_tokens=300,
                   temperature=0.8, seed=i, response_format=listing)
        else:
            c.generate(f"Story {i}: once upon a time", max_tokens=200, temperature=0)
    ts = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    time.sleep(3)
    for _ in range(4):
        st = c.status(); samples.append((st["memory_pss_mb"], round(ray_pss(), 1))); time.sleep(1)
    [t.join() for t in ts]
    out["under_8_streams"] = {"socllm_pss_mb": max(s[0] for s in samples), "ray_and_socllm_pss_mb": max(s[1] for s in samples), "samples": samples}
    for w in range(3):
        ts = [threading.Thread(target=c.generate, args=(f"Wave {w}, story {i}: in a distant land there lived",),
                               kwargs={"max_tokens": 300, "temperature": 0}) for i in range(8)]
        [t.start() for t in ts]
        [t.join() for t in ts]
    time.sleep(6)
    st = c.status()
    out["idle_after_use"] = {"socllm_pss_mb": st["memory_pss_mb"], "by_process": st["memory_pss_mb_by_process"],
                             "ray_and_socllm_pss_mb": round(ray_pss(), 1), "kv": st["kv"]}
    window = st["kv"].get("idle_s") or 0
    if window and "--no-release" not in sys.argv:
        end = time.monotonic() + window + 60
        while c.status()["kv"].get("drops") == st["kv"].get("drops") and time.monotonic() < end:
            time.sleep(1)
        time.sleep(2)
        st = c.status()
        out["idle_after_release"] = {"socllm_pss_mb": st["memory_pss_mb"], "by_process": st["memory_pss_mb_by_process"],
                                     "ray_and_socllm_pss_mb": round(ray_pss(), 1), "kv": st["kv"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
