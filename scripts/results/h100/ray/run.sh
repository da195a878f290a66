# socllm's Ray engine on the lent NVIDIA machine: `socllm info`, then `socllm generate --plan gpu`
# on a SmolLM2-shaped model with random weights, its tokens against the numpy oracle's.
set -u
source scripts/results/h100/device_env.sh
nvidia-smi -L | tee $OUT/device.txt
python3 -m socllm.actors.cli info > $OUT/info.txt 2>&1; cat $OUT/info.txt
for rep in 1 2; do
  /usr/bin/time -f "wall %e s" python3 -m socllm.actors.cli generate --model /tmp/smollm2-shaped.gguf \
      --plan gpu --precision f32 --local --json --max-tokens 16 "The capital of France is" \
      > $OUT/gen$rep.json 2> $OUT/gen$rep.err; tail -2 $OUT/gen$rep.err
done
/usr/bin/time -f "wall %e s" python3 -m socllm.actors.cli generate --model /tmp/smollm2-shaped.gguf \
    --plan gpu --precision q16 --local --json --max-tokens 64 "The capital of France is" \
    > $OUT/gen-q16.json 2> $OUT/gen-q16.err; tail -2 $OUT/gen-q16.err
python3 - <<'PY'
import json, os
from socllm.models.gguf_file import open_gguf
from socllm.models.llama import load_config, load_weights
from socllm.models.oracle import Oracle
out = os.environ["OUT"]
r = open_gguf("/tmp/smollm2-shaped.gguf"); cfg = load_config(r)
o = Oracle(cfg, load_weights(r, cfg))
for f in ("gen1.json", "gen2.json", "gen-q16.json"):
    try:
        g = json.load(open(f"{out}/{f}"))
    except Exception as e:
        print(f, "no output:", e); continue
    want = o.greedy(g["prompt_tokens"], len(g["tokens"]))
    print(f, "plan", g["plan"], g["placement"], "precision", g["precision"], "timings",
          {k: round(v, 3) for k, v in g["timings"].items()}, "tokens == oracle:", g["tokens"] == want,
          sum(a == b for a, b in zip(g["tokens"], want)), "/", len(want))
PY
