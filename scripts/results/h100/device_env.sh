# Sourced by ray/run.sh and serve/serve.sh on the lent NVIDIA machine, from the repository root:
# Ray's wheel joined from its two carried pieces (.rayA's, copied to /tmp/parts by the call
# before, and .rayB's), the wheels installed under /tmp/site, NVIDIA's OpenCL registered, socllm
# importable from the checkout, and a SmolLM2-shaped model with random weights written.
cat /tmp/parts/part.aa .rayB/part.ab > /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .rayB/*.whl /tmp/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl || exit 1
mkdir -p /etc/OpenCL/vendors && echo /usr/local/nvidia/lib64/libnvidia-opencl.so.1 > /etc/OpenCL/vendors/nvidia.icd
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/socllm
export PYTHONPATH=/tmp/pkg:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
python3 - <<'PY'
from socllm.models.synthetic import write_tiny
write_tiny("/tmp/smollm2-shaped.gguf", matrix="Q4_1", dim=576, ffn=1536, layers=30, heads=9,
           kv_heads=3, head_dim=64, vocab=49152, random=True, context=4096)
PY
