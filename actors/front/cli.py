"""`socllm` command line: generate, serve, status, stop, info, bench, inspect, models, plan, simulate,
calibrate, moefy.

Bad input (a missing model, an empty prompt, a bad option value) gets one line on stderr and
exit status 2, before any actor or segment exists, or after all of them are torn down.
`generate` uses the running service (`socllm serve`) when there is one, else (or with --local)
a private engine for the one request.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys

from socllm.policies.agent import POLICIES
from socllm.policies.config import SERVE_PLAN_NAMES, SERVE_PRECISIONS, EngineConfig, ServeConfig
from socllm.policies.drafting import MODES as SPECULATE
from socllm.policies.sampling import BadParam


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


ADDRESS_HELP = ("the Ray cluster (host:port of its GCS); default: RAY_ADDRESS, else the cluster "
                "`ray start` recorded in Ray's temp dir (RAY_TMPDIR, TMPDIR or /tmp)")


def config_of(a, cls):
    """The config (policies/config.py) of the parsed flags that name its fields (--max-seqs:
    max_seqs), the rest of its knobs from the environment; a flag left unset (None) keeps the
    field's default."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls.from_env(**{k: v for k, v in vars(a).items() if k in names and v is not None})


def _flag(e: BadParam) -> str:
    """A config error said in the command line's terms: a field as the flag that sets it (a
    variable's name stays)."""
    name = e.field if e.field.startswith("SOCLLM_") else "--" + e.field.replace("_", "-")
    return f"{name} {e.message}"


SPECULATE_HELP = ("speculative decoding: drafts from n-grams of the prompt and the text so far "
                  "(lookup) or from the model's draft heads (heads, where models/heads has them), "
                  "verified as extra rows of a decode step (the same tokens as without); auto: "
                  "either, where this device's measured step costs and the acceptance so far say "
                  "it pays; lookup / heads: that drafter whenever it has a draft; off")


def _parser() -> argparse.ArgumentParser:
    eng, srv = EngineConfig(), ServeConfig()     # every default below is a config field's
    p = _Parser(prog="socllm", description="LLM inference across the CPU, GPU and NPU of this device")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a continuation of PROMPT")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="keep tokens at least this times the likeliest's probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="tokens of the prompt and the text so far made less likely (1: off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--plan", choices=SERVE_PLAN_NAMES, default=None,
                   help="as serve's (default: a running service's, else auto)")
    # unset: a running service's precision, else the config's (generate_served compares)
    g.add_argument("--precision", choices=SERVE_PRECISIONS, default=None,
                   help="activations: f32 (the oracle's path), q16 / q8 (int16 / int8 activations "
                        f"in the GPU's decode matmuls); default: {eng.precision}")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--model", default=None, help="a GGUF file, or gemma3-270m (its package) "
                   "(default: SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--context", type=int, default=eng.context)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--local", action="store_true",
                   help="a private engine for this request, even when a service runs")
    g.add_argument("--priority", choices=("reactive", "proactive"), default="reactive",
                   help="the request's class in a running service (default: reactive)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the text before TEXT (up to 4 times)")
    g.add_argument("--address", default=None, help=ADDRESS_HELP + "; none found: a private engine")
    g.add_argument("--speculate", choices=SPECULATE, default=None,
                   help=f"{SPECULATE_HELP} (default: a running service's, else off: a private "
                        "engine builds its kernels as they are first used, which costs a short "
                        "request more than drafts save)")
    g.add_argument("--draft-max", type=int, default=None,
                   help=f"a private engine's most drafted tokens a step (default {srv.draft_max})")
    g.add_argument("--hcmp-share", type=float, default=None,
                   help="as serve's (default: a running service's, else timed at start)")
    s = sub.add_parser("serve", help="start the socllm service in the running Ray cluster")
    s.add_argument("--model", default=None, help="a GGUF file, or gemma3-270m (its package) "
                   "(default: SmolLM2-135M-Instruct Q4_1)")
    s.add_argument("--context", type=int, default=srv.context,
                   help="tokens a request may hold (default %(default)s)")
    s.add_argument("--max-seqs", type=int, default=srv.max_seqs,
                   help="requests decoding at once, one batched step (default %(default)s)")
    s.add_argument("--kv-mb", type=float, default=srv.kv_mb,
                   help="the paged KV cache, MB (default %(default)s; pages are touched as requests use them)")
    s.add_argument("--precision", choices=SERVE_PRECISIONS, default=srv.precision,
                   help="activations of the linears: q16 int16 (f32's perplexity and greedy text), "
                        "q8 int8 per 32-block as llama.cpp's (the throughput setting: faster "
                        "prefill and batches, llama.cpp's perplexity), f32 the numpy oracle's "
                        "exact path (default %(default)s)")
    s.add_argument("--policy", choices=sorted(POLICIES), default=srv.policy,
                   help="scheduling policy (default %(default)s; agent: reactive requests first; "
                        "fcfs: arrival order)")
    s.add_argument("--plan", choices=SERVE_PLAN_NAMES, default=srv.plan,
                   help="what runs decode batches and prompt chunks (default %(default)s: prefill "
                        "on whichever of the GPU's kernels and the NPU's static graphs ran a chunk "
                        "faster at start, cached per model and device; hetero: prefill on the NPU, "
                        "decode on the GPU; tensor: linears row-cut GPU+NPU; seqcut: a chunk's rows "
                        "cut NPU+GPU; hybrid: chunks padded to NPU buckets and row-cut; hcmp: decode "
                        "steps' attention split GPU (the KV cache) + CPU (drafted keys); cpu/gpu/npu: "
                        "one processor)")
    s.add_argument("--hcmp-share", type=float, default=srv.hcmp_share,
                   help="the hcmp plan's share of each linear's output columns on the CPU actor "
                        "(default: Ghidorah's ARCA, timed at start under contention, a share per "
                        "band of context, cached per model and device)")
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=srv.prefix_cache,
                   help="prefill every prompt whole: no reuse of the K/V of a prefix sent before "
                        "(a system prompt, a tool list, a chat's history); to compare")
    s.add_argument("--prefix-cache-mb", type=float, default=srv.prefix_cache_mb,
                   help="the most K/V the prefix cache keeps for later requests while no request "
                        "holds it, MB (default %(default)s); the KV cache's other unused pages go "
                        "back to the OS")
    s.add_argument("--prefix-cache-idle-s", type=float, default=srv.prefix_cache_idle_s,
                   help="seconds the service stays idle (nothing running or waiting) before the "
                        "prefix cache lets its K/V go back to the OS, as Ollama unloads an idle "
                        "model (default %(default)s; 0: kept while the service runs)")
    s.add_argument("--no-warmup", dest="warm", action="store_false", default=srv.warm,
                   help="start without running every kernel and graph once (as llama-server's "
                        "--no-warmup): a faster start, and the first requests build what they use")
    s.add_argument("--speculate", choices=SPECULATE, default=srv.speculate,
                   help=f"{SPECULATE_HELP} (default %(default)s); a request's own speculate field "
                        "chooses for it unless this is off")
    s.add_argument("--draft-max", type=int, default=srv.draft_max,
                   help="tokens one request drafts in a step, at most (default %(default)s)")
    s.add_argument("--draft-ranks", type=int, default=srv.draft_ranks,
                   help="the draft heads' candidates per head: 2 or more verify a tree of them, "
                        "1 a chain of each head's likeliest (default %(default)s)")
    s.add_argument("--abandon-s", type=float, default=srv.abandon_s,
                   help="cancel a running request whose client has not asked for its text this "
                        "long: the client is gone (default %(default)s)")
    s.add_argument("--http-port", type=int, default=srv.http_port,
                   help="the OpenAI-compatible HTTP endpoint's port; 0: no HTTP (default %(default)s)")
    s.add_argument("--http-host", default=srv.http_host, help="default %(default)s (this device only)")
    s.add_argument("--api-key", default=None, help="HTTP requires `Authorization: Bearer KEY` "
                   "(/health stays open); better from SOCLLM_API_KEY, which no process list shows")
    s.add_argument("--max-body-mb", type=float, default=srv.max_body_mb,
                   help="a larger HTTP body is refused with 413 (default %(default)s)")
    s.add_argument("--max-waiting", type=int, default=srv.max_waiting,
                   help="requests waiting to start; one more is refused (HTTP 429, Retry-After; "
                        "Python: QueueFull) (default %(default)s)")
    s.add_argument("--address", default=None, help=ADDRESS_HELP)
    st = sub.add_parser("status", help="what the running service does: requests, KV, processors, memory")
    st.add_argument("--json", action="store_true")
    st.add_argument("--address", default=None, help=ADDRESS_HELP)
    sp = sub.add_parser("stop", help="remove the socllm service from the Ray cluster (Ray stays up)")
    sp.add_argument("--address", default=None, help=ADDRESS_HELP)
    sub.add_parser("info", help="list the processors found and which actor uses which")
    sub.add_parser("bench", help="socllm against llama.cpp and OpenVINO GenAI (socllm bench --help)")
    i = sub.add_parser("inspect", help="what a GGUF holds and whether socllm runs it (exit 0: it runs, 1: not)")
    i.add_argument("file")
    i.add_argument("--json", action="store_true")
    m = sub.add_parser("models", help="the model families and tensor types this build runs, per processor")
    m.add_argument("--json", action="store_true")
    from socllm.actors.front.simulate import add_parser
    add_parser(sub)
    from socllm.actors.front.plan import add_parser as add_plan
    add_plan(sub)
    from socllm.actors.front.calibrate import add_parser as add_calibrate
    add_calibrate(sub)
    from socllm.actors.front.moefy import add_parser as add_moefy
    add_moefy(sub)
    return p


def _validate(a):
    from socllm.policies.request import check_stop
    from socllm.policies.sampling import SamplingParams
    SamplingParams(a.max_tokens, a.temperature, a.top_p, a.seed, top_k=a.top_k, min_p=a.min_p,
                   repetition_penalty=a.repetition_penalty)   # raises ValueError
    check_stop(a.stop)
    if not a.prompt.strip():
        raise ValueError("the prompt is empty")
    if a.model is not None and not os.path.isfile(a.model):
        raise ValueError(f"model file not found: {a.model}")
    a.config = config_of(a, EngineConfig)        # a bad value fails here, before Ray
    if a.context != EngineConfig.context:        # asked for: within the model's (~0.2 s to read)
        check_context(a.model, a.context)


def check_context(model: str | None, context: int):
    """The context against the model's, before any process starts (the engine refuses it too,
    but only once it has started)."""
    from socllm.models.gguf_file import model_path, open_gguf
    from socllm.models.llama import load_config
    most = load_config(open_gguf(model_path(model))).context_length
    if context > most:
        raise ValueError(f"--context must be in [16, {most}] for this model, got {context}")


def _generate(a) -> int:
    if not a.local:
        from socllm.actors.front.direct import generate_direct
        done = generate_direct(a)                # no Ray imported: a running service's HTTP
        if done is None:
            from socllm.actors.front.serve import generate_served
            done = generate_served(a)
        if done is not None:
            return done
    from socllm.models.chat import chat_prompt
    from socllm.models.gguf_file import default_model_path, open_gguf
    from socllm.models.llama import load_config
    from socllm.models.tokenizer import Tokenizer
    from socllm.policies.buckets import MAX_CHUNK, bucket_for
    from socllm.actors.front.serve import generate_private
    # everything that can be wrong with the input fails here, before Ray or the pool exist
    reader = open_gguf(a.model or default_model_path())
    cfg = load_config(reader)
    tok = Tokenizer(reader)
    n = len(tok.encode(chat_prompt(reader, a.prompt) if a.chat else a.prompt, bos=tok.add_bos))
    if n >= a.context:
        raise ValueError(f"the prompt has {n} tokens; the context holds {a.context}")
    del reader, tok              # the GGUF's mapping goes with them
    # the KV cache of one sequence of the context (f16 elements, f32 at f32), a block over
    row = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * (4 if a.config.precision == "f32" else 2)
    # the prompt in one chunk: a static NPU graph of the bucket that holds it (auto times the
    # GPU and the NPU at that size the first time, policies/buckets.py PREFILL_BUCKETS)
    chunk = bucket_for(min(n, MAX_CHUNK))
    return generate_private(a, max(1.0, (a.context + chunk) * row / 2**20), chunk)


def _info(a) -> int:
    from socllm.actors.front.devices import describe_devices
    print(json.dumps(describe_devices(), indent=2))
    return 0


def _inspect(a) -> int:
    from socllm.models.inspect import inspect
    if not os.path.isfile(a.file):
        raise ValueError(f"{a.file} is a directory, not a GGUF file" if os.path.isdir(a.file)
                         else f"model file not found: {a.file}")
    d = inspect(a.file)
    if a.json:
        print(json.dumps(d, indent=2))
        return 0 if d["runs"] else 1
    c = d["config"]
    print(f"file        {os.path.basename(d['file'])} ({d['file_mb']} MB)")
    print(f"name        {d['name'] or '-'}")
    print(f"arch        {d['architecture']}, {d['parameters'] / 1e6:.1f} M parameters")
    print(f"config      {c['layers']} layers, dim {c['dim']}, ffn {c['ffn_dim']}, {c['heads']} heads "
          f"({c['kv_heads']} kv), vocab {c['vocab']}, context {c['context']}, rope base {c['rope_base']}")
    print("tensors     " + ", ".join(f"{k} {v['tensors']} ({v['mb']} MB)" for k, v in d["tensor_types"].items()))
    print(f"tokenizer   {d['tokenizer']['model']} (pre: {d['tokenizer']['pre']})")
    t = d["chat_template"]
    print(f"chat        {'a template of %d characters' % len(t) if t else 'no template'}")
    if d["runs"]:
        print("socllm      runs it")
        for p, how in d["processors"].items():
            print(f"  {p:<10}{how}")
        return 0
    print("socllm      does not run it:")
    for p in d["problems"]:
        print(f"              - {p}")
    return 1


def _models(a) -> int:
    from socllm.models.inspect import supported
    d = supported()
    if a.json:
        print(json.dumps(d, indent=2))
        return 0
    for name, f in d["families"].items():
        print(f"{name:<8} {'runs' if f['runs'] else 'not yet'}: {f['what']}")
    print()
    procs = sorted({p for v in d["tensor_types"].values() for p in v})
    types = list(dict.fromkeys(t for per in d["tensor_types"].values() for ts in per.values() for t in ts))
    for role, per in d["tensor_types"].items():
        print(f"{role:<28}" + "".join(f"{p:<6}" for p in procs))
        for t in types:
            if any(t in per.get(p, []) for p in procs):
                print(f"  {t:<26}" + "".join(f"{'yes' if t in per.get(p, []) else '-':<6}" for p in procs))
    return 0


def main(argv=None) -> int:
    # Ctrl-C and SIGTERM unwind through the engine's `finally`: actors killed, segment unlinked.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:                      # its own argument parser (scripts/bench.py)
        from socllm.scripts.bench import main as bench
        return bench(argv[1:])
    try:
        a = _parser().parse_args(argv)
        if getattr(a, "model", None):
            from socllm.models.gguf_file import model_path
            a.model = model_path(a.model)              # a packaged model's name -> its file
        if a.cmd == "inspect":
            from socllm.models.gguf_file import model_path
            a.file = model_path(a.file)
        if a.cmd == "generate":
            _validate(a)
            return _generate(a)
        if a.cmd in ("serve", "status", "stop"):
            from socllm.actors.front import serve as serve_cli
            return getattr(serve_cli, a.cmd)(a)
        if a.cmd == "inspect":
            return _inspect(a)
        if a.cmd == "models":
            return _models(a)
        if a.cmd == "plan":
            from socllm.actors.front.plan import run as plan
            return plan(a)
        if a.cmd == "calibrate":
            from socllm.actors.front.calibrate import run as calibrate
            return calibrate(a)
        if a.cmd == "moefy":
            from socllm.actors.front.moefy import run as moefy
            return moefy(a)
        if a.cmd == "simulate":
            from socllm.actors.front.simulate import run
            return run(a)
        return _info(a)
    except UsageError as e:
        print(f"socllm: error: {e}", file=sys.stderr)
        return 2
    except BadParam as e:          # a config knob or a sampling parameter
        print(f"socllm: error: {_flag(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("socllm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:        # the reader of our output went (`| head`): as other tools, quietly
        return 141
    except (ValueError, NotImplementedError, FileNotFoundError, PermissionError, LookupError) as e:
        print(f"socllm: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


def run():
    """The `socllm` command: main(), then an exit that skips the interpreter's teardown of Ray,
    numpy and OpenCL's modules (~0.4 s of `socllm generate`'s wall time here). What must end
    has ended by then: a private Ray is stopped and a joined one disconnected (without the
    half-second pause Ray's exit hook takes to let logs print), output flushed."""
    rc = main()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):          # a closed pipe (`| head`)
            pass
    os._exit(rc if isinstance(rc, int) else 1)


if __name__ == "__main__":
    run()
