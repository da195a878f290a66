#!/usr/bin/env bash
# socllm's GPU kernels on an NVIDIA GPU through NVIDIA's OpenCL, beside llama.cpp built with CUDA
# on the same machine. Run from the repository root on a machine with the GPU, nvcc and CMake:
#
#   WHEELS=.whl LLAMA_SRC=.llama OUT=results bash scripts/nvidia_opencl.sh
#
#   WHEELS     a folder of the Python packages socllm's kernels need, as wheels, where pip cannot
#              fetch them (pyopencl, pytools, platformdirs, siphash24, gguf); empty: installed
#   LLAMA_SRC  llama.cpp's source (the vendor/llama.cpp tree of the llama-cpp-python sdist)
#   OCL_ICD    NVIDIA's OpenCL library, registered with the ICD loader if no vendor file exists
#
# 1. the OpenCL kernel tests (tests/test_kernels_cl.py) on the GPU: each test's arena is copied to
#    the device and back around its launches (kernels_cl.Mirror);
# 2. scripts/gpu_decode.py: a prompt's greedy tokens against the numpy oracle (f32), then prefill
#    and decode tokens/s at q16 and f32, on models of SmolLM2-135M's and Gemma 3 270M's shapes
#    and formats with random weights (models/synthetic.py), the weights uploaded once;
# 3. llama.cpp's llama-bench (CUDA, all layers on the GPU) on the same files.
set -u
PY=${PYTHON:-python3}
W=$(mktemp -d "${TMPDIR:-/tmp}/socllm-nv.XXXXXXXX")     # never a fixed /tmp path another user could plant
trap 'rm -rf "$W"' EXIT
OUT=${OUT:-results}; mkdir -p "$OUT"
OCL_ICD=${OCL_ICD:-/usr/local/nvidia/lib64/libnvidia-opencl.so.1}
if [ ! -e /etc/OpenCL/vendors/nvidia.icd ] && [ -e "$OCL_ICD" ]; then
    mkdir -p /etc/OpenCL/vendors && echo "$OCL_ICD" > /etc/OpenCL/vendors/nvidia.icd
fi
if [ -n "${WHEELS:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$W/site" "$WHEELS"/*.whl || exit 1
    mkdir -p "$W/pkg" && ln -sfn "$PWD" "$W/pkg/socllm"
    export PYTHONPATH="$W/pkg:$W/site"
fi
nvidia-smi -L 2>/dev/null | tee "$OUT/device.txt"
if [ -n "${LLAMA_SRC:-}" ]; then          # built first: nothing else runs while it compiles
    t0=$(date +%s)
    cmake -S "$LLAMA_SRC" -B "$W/llama-build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DCMAKE_BUILD_TYPE=Release > "$OUT/llama-build.log" 2>&1
    timeout "${BUILD_S:-330}" cmake --build "$W/llama-build" -j "$(nproc)" --target llama-bench \
        >> "$OUT/llama-build.log" 2>&1
    echo "llama.cpp build: rc $? in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/device.txt"
fi
if [ "${KERNEL_TESTS:-1}" = 1 ]; then     # ~9 minutes on a fresh H100: NVIDIA compiles every build
    $PY -m pytest -q -p no:cacheprovider --noconftest tests/test_kernels_cl.py \
        --deselect tests/test_kernels_cl.py::test_linear_real_gguf_weight > "$OUT/kernel-tests.log" 2>&1
    tail -1 "$OUT/kernel-tests.log"
fi
W="$W" $PY - <<'EOF'
import os
from socllm.models.synthetic import write_tiny
w = os.environ["W"]
write_tiny(f"{w}/smollm2-shaped.gguf", matrix="Q4_1", dim=576, ffn=1536, layers=30, heads=9,
           kv_heads=3, head_dim=64, vocab=49152, random=True, context=4096)
write_tiny(f"{w}/gemma3-shaped.gguf", arch="gemma3", matrix="Q5_0", dim=640, ffn=2048, layers=18,
           heads=4, kv_heads=1, head_dim=256, vocab=262144, random=True, context=4096, window=64,
           swa_pattern=6, types={f"blk.{i}.ffn_down.weight": "Q6_K" for i in range(18)})
EOF
for m in smollm2 gemma3; do
    $PY -m socllm.scripts.gpu_decode --model "$W/$m-shaped.gguf" --precision f32 --reps 1 \
        --check 24 --decode 24 --json "$OUT/$m-f32.json" > "$OUT/$m-f32.txt" 2>&1
    $PY -m socllm.scripts.gpu_decode --model "$W/$m-shaped.gguf" --precision q16 \
        --prompt-len 128 --decode 64 --reps 3 --json "$OUT/$m-q16.json" > "$OUT/$m-q16.txt" 2>&1
    tail -qn1 "$OUT/$m-f32.txt" "$OUT/$m-q16.txt"
    if [ -x "$W/llama-build"/bin/llama-bench ]; then
        "$W/llama-build"/bin/llama-bench -m "$W/$m-shaped.gguf" -p 128 -n 64 -ngl 99 -r 3 -o json \
            > "$OUT/$m-llama-bench.json" 2> "$OUT/$m-llama-bench.err"
        grep -E '"(n_prompt|n_gen|avg_ts)"' "$OUT/$m-llama-bench.json" | tr -d '\n ' ; echo
    fi
done
