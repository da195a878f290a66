"""Time to first token of the second request of a pair sharing a ~1,000-token prefix (agent_api_bench's
pairs), over HTTP and through the Python client, and of a 4-token prompt both ways: what the HTTP
hop (Ray Serve's proxy and replica) adds. Alternates the paths pair by pair.

    python -m socllm.scripts.ttft_paths          # prints ms per path
"""
import json, time, statistics, requests, ray
from socllm.scripts.agent_api_bench import Socllm, prefixes
from socllm.models.gguf_file import default_model_path, open_gguf
from socllm.models.tokenizer import Tokenizer
from socllm.actors.front.client import Client
g = default_model_path(); tk = Tokenizer(open_gguf(g))
texts = prefixes(1000, 6, tk)
e = Socllm(g, True, 2048); url = e.start(); c = Client(e.svc)
def http(prompt):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    t0=time.perf_counter()
    with requests.post(url + "/v1/completions", json=body, stream=True) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                return time.perf_counter()-t0
def py(prompt):
    t0=time.perf_counter()
    for p in c.generate(prompt, max_tokens=8, stream=True):
        if p: return time.perf_counter()-t0
res={"http":[], "python":[], "http_short":[], "python_short":[]}
try:
    for i,t in enumerate(texts):
        f = http if i % 2 == 0 else py
        f(t + "\nQuestion: who is Mr. Bennet? Answer:")
        res["http" if f is http else "python"].append(f(t + "\nQuestion: where does Mr. Bingley live? Answer:"))
    for i in range(6):
        res["http_short"].append(http(f"Hello there {i}")); res["python_short"].append(py(f"Hi there {i}"))
finally:
    e.stop()
print({k: [round(1e3 * x, 1) for x in v] for k, v in res.items()})
