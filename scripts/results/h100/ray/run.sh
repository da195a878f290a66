# socllm's Ray engine on the lent NVIDIA machine: `socllm info`, then `socllm generate --plan gpu`
# on a SmolLM2-shaped model with random weights, its tokens against the numpy oracle's.
set -u
cat /tmp/parts/part.aa .rayB/part.ab > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .rayB/*.whl /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl || exit 1
mkdir -p /etc/OpenCL/vendors && echo /usr/local/nvidia/lib64/libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/socllm
export PYTHONPATH=/tmp/pkg:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/device.txt
python3 - <<'PY'
from socllm.models.synthetic import write_tiny
write_tiny("/tmp/smollm2-shaped.gguf", matrix="Q4_1", dim=576, ffn=1536, layers=30, heads=9,
           kv_heads=3, head_dim=64, vocab=49152, random=True, context=4096)
PY
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
