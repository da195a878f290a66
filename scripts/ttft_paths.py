"""Time to first token of the second request of a pair sharing a ~1,000-token prefix (agent_api_bench's
pairs), over HTTP and through the Python client, and of a 4-token prompt both ways: what the HTTP
hop (Ray Serve's proxy and replica) adds. The paths alternate pair by pair.

    python -m socllm.scripts.ttft_paths          # prints ms per path
"""
from __future__ import annotations

import json
import time

import requests

from .agent_api_bench import Socllm, prefixes

QUESTIONS = ("\nQuestion: who is Mr. Bennet? Answer:", "\nQuestion: where does Mr. Bingley live? Answer:")


def main():
    from socllm.actors.front.client import Client
    from socllm.models.gguf_file import default_model_path, open_gguf
    from socllm.models.tokenizer import Tokenizer
    gguf = default_model_path()
    texts = prefixes(1000, 6, Tokenizer(open_gguf(gguf)))
    eng = Socllm(gguf, True, 2048)
    url = eng.start()
    client = Client(eng.svc)

    def http(prompt: str) -> float:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0].get("text"):
                    return time.perf_counter() - t0

    def python(prompt: str) -> float:
        t0 = time.perf_counter()
        for piece in client.generate(prompt, max_tokens=8, stream=True):
            if piece:
                return time.perf_counter() - t0

    out = {"http": [], "python": [], "http_short": [], "python_short": []}
    try:
        for i, text in enumerate(texts):
            path = http if i % 2 == 0 else python
            path(text + QUESTIONS[0])
            out[path.__name__].append(path(text + QUESTIONS[1]))
        for i in range(6):
            out["http_short"].append(http(f"Hello there {i}"))
            out["python_short"].append(python(f"Hi there {i}"))
    finally:
        eng.stop()
    print({k: [round(1e3 * x, 1) for x in v] for k, v in out.items()})


if __name__ == "__main__":
    main()
