# socllm's service on the lent NVIDIA machine: ray start, socllm serve (f32, no HTTP), the Python
# client's greedy text against the oracle's, 1 and 8 concurrent streams, status, stop.
set -u
source scripts/results/h100/device_env.sh
RAY_worker_niceness=0 ray start --head --disable-usage-stats --include-dashboard=false > $OUT/ray.txt 2>&1
/usr/bin/time -f "serve: wall %e s" python3 -m socllm.actors.cli serve --http-port 0 --model /tmp/smollm2-shaped.gguf \
    --precision f32 --max-seqs 8 --kv-mb 256 --context 1024 2>&1 | tee $OUT/serve.txt
python3 - <<'PY' 2>&1 | tee $OUT/clients.txt
import json, os, time, threading
import socllm
from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
from socllm.models.tokenizer import Tokenizer
c = socllm.connect()
r = open_gguf("/tmp/smollm2-shaped.gguf"); cfg = load_config(r); tok = Tokenizer(r)
o = Oracle(cfg, load_weights(r, cfg))
prompt = "The capital of France is"
ids = tok.encode(prompt, bos=tok.add_bos)
want = tok.decode(o.greedy(ids, 24))
got = c.generate(prompt, max_tokens=24, temperature=0)
print("greedy text == oracle:", got == want[:len(got)] and len(got) > 0, len(got), len(want))
for n in (1, 8):
    texts, t0 = [None] * n, time.perf_counter()
    def one(i):
        texts[i] = "".join(c.generate(f"{prompt} {i}", max_tokens=64, stream=True))
    th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in th]; [t.join() for t in th]
    dt = time.perf_counter() - t0
    st = c.status()
    print(f"{n} streams: {n * 64 / dt:.1f} tok/s aggregate (64 tokens each, wall {dt:.2f} s)")
st = c.status()
print("status:", json.dumps({k: st.get(k) for k in ("plan", "precision", "prefill", "decode_step_ms", "memory_pss_mb", "memory_pss_mb_by_process", "loop")}))
print("processors:", [(p["processor"], p.get("device")) for p in st["processors"]])
PY
python3 -m socllm.actors.cli stop 2>&1 | tail -1
ray stop > /dev/null 2>&1; echo done
