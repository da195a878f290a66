"""The engines a user would otherwise pick, measured on the same GGUF and the same prompt ids:
llama.cpp (llama-cpp-python) and OpenVINO GenAI (LLMPipeline loads the GGUF directly).

Every runner has `run(ids, n_decode) -> {"ttft_s", "prefill_tok_s", "decode_tok_s", "tokens"}`:
greedy, no stop at EOS, the first token counted in TTFT, decode over the remaining n_decode - 1.
A runner whose package is missing raises `PeerMissing` with the install hint.

`PeerProcess(name, ...)` runs one of them in a process of its own (`python -m
socllm.scripts.peers --serve`, one JSON line each way), as the benchmarks use them: a peer's
threads (llama.cpp's, OpenVINO's TBB workers) spin for a while after each call, and in the
benchmark's own process they did so on the cores the next engine's run had (spec_bench measured
both engines 25-35 % slower that way on the 2-core Xeon VM).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np


class PeerMissing(RuntimeError):
    pass


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, model_path: str, threads: int, context: int = 2048):
        try:
            from llama_cpp import Llama
        except ImportError as e:
            raise PeerMissing(f"llama-cpp-python is not installed (pip install -e '.[bench]'): {e}")
        self.llm = Llama(model_path=model_path, n_ctx=context, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)
        import llama_cpp
        self.version = llama_cpp.__version__

    def run(self, ids: list, n_decode: int) -> dict:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = self._argmax()
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n_decode - 1):
            llm.eval([tok])
            tok = self._argmax()
            out.append(tok)
        t2 = time.perf_counter()
        return _timings(len(ids), out, t0, t1, t2)


    def _argmax(self) -> int:
        # with logits_all=False, Llama.eval keeps no scores: read the context's last logits
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(np.argmax(logits))


class OpenVINOGenAI:
    name = "openvino-genai"

    def __init__(self, model_path: str, threads: int, context: int = 2048):
        try:
            import openvino as ov
            import openvino_genai as ov_genai
        except ImportError as e:
            raise PeerMissing(f"openvino-genai is not installed (pip install -e '.[bench]'): {e}")
        self.ov, self.genai = ov, ov_genai
        try:
            self.pipe = ov_genai.LLMPipeline(model_path, "CPU", INFERENCE_NUM_THREADS=threads)
        except RuntimeError as e:     # its GGUF reader takes Q4_0, Q4_1, Q8_0, Q4_K and Q6_K only
            lines = [s for s in str(e).splitlines() if s.strip()]
            raise PeerMissing(f"openvino-genai cannot load {os.path.basename(model_path)}: "
                              f"{lines[-1] if lines else type(e).__name__}") from None
        self.version = ov_genai.__version__

    def run(self, ids: list, n_decode: int) -> dict:
        cfg = self.genai.GenerationConfig()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.do_sample = n_decode, n_decode, False
        cfg.ignore_eos = True
        t0 = time.perf_counter()
        res = self.pipe.generate(self.ov.Tensor(np.array([ids], np.int64)), cfg)
        t2 = time.perf_counter()
        pm = res.perf_metrics
        ttft = pm.get_ttft().mean / 1e3
        tokens = [int(t) for t in res.tokens[0]]
        return {"ttft_s": ttft, "prefill_tok_s": len(ids) / ttft,
                "decode_tok_s": 1e3 / pm.get_tpot().mean, "tokens": tokens,
                "wall_s": t2 - t0}


def _timings(n_prompt, out, t0, t1, t2) -> dict:
    return {"ttft_s": t1 - t0, "prefill_tok_s": n_prompt / (t1 - t0),
            "decode_tok_s": (len(out) - 1) / (t2 - t1) if len(out) > 1 else 0.0, "tokens": out}


PEERS = {"llama.cpp": LlamaCpp, "openvino-genai": OpenVINOGenAI}


class LineChild:
    """A child process `python -m <module> <flag> <spec JSON>` asked over a pipe, one JSON line
    each way (ask), until close() ends its stdin (serve_lines is the child's side)."""

    def __init__(self, name: str, module: str, flag: str, spec: list):
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", module, flag, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def ask(self, obj) -> dict:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve_lines(answer) -> int:
    """The child's side of LineChild: answer(request) for each line of stdin, until it closes."""
    for line in sys.stdin:
        print(json.dumps(answer(json.loads(line))), flush=True)
    return 0


class PeerProcess(LineChild):
    """PEERS[name](model_path, threads, context) in a child process: the same `run(ids,
    n_decode)`, `name` and `version`; `pid` for its memory. Raises PeerMissing as the peer does."""

    def __init__(self, name: str, model_path: str, threads: int, context: int = 2048):
        super().__init__(name, "socllm.scripts.peers", "--serve", [name, model_path, threads, context])
        hello = self.read()
        if "missing" in hello:
            self.close()
            raise PeerMissing(hello["missing"])
        self.version = hello["version"]

    def run(self, ids: list, n_decode: int) -> dict:
        return self.ask([[int(i) for i in ids], n_decode])


def _serve(spec: str) -> int:
    """--serve: one peer answering PeerProcess's lines until stdin closes."""
    name, model_path, threads, context = json.loads(spec)
    try:
        peer = PEERS[name](model_path, threads, context)
    except PeerMissing as e:
        print(json.dumps({"missing": str(e)}), flush=True)
        return 0
    print(json.dumps({"version": getattr(peer, "version", None)}), flush=True)
    return serve_lines(lambda req: peer.run(*req))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--serve"] or len(sys.argv) != 3:
        print("usage: python -m socllm.scripts.peers --serve '[name, model, threads, context]'",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(_serve(sys.argv[2]))
