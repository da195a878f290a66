"""`socllm serve | status | stop`, and `socllm generate` through a running service.

The service lives in the Ray cluster the user started (`ray start --head`), as the detached actor
NAME in the NAMESPACE namespace (actors/service.py), so it outlives these commands.
"""
from __future__ import annotations

import json
import os
import socket
import sys

from socllm.policies.placement import NPU_MARGIN, PROCESSORS_OF

from socllm.actors.front.cluster import NAME, NAMESPACE

def _join(address: str | None) -> str:
    """Join the Ray cluster the user runs (actors/front/cluster.py: --address, RAY_ADDRESS, Ray's
    cluster file) and return its address; NoCluster, naming what was tried, if none answers.
    Nothing is started."""
    from socllm.actors.front.cluster import join
    return join(address, NAMESPACE)


def _service():
    import ray
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def serve(a) -> int:
    import dataclasses

    import ray

    from socllm.policies.config import ServeConfig
    from socllm.actors.front.cluster import ray_env_options
    from socllm.actors.front.cli import check_context, config_of
    from socllm.actors.service import Service
    if a.model is not None and not os.path.isfile(a.model):
        raise ValueError(f"model file not found: {a.model}")
    if a.model is not None:
        from socllm.models.gguf_file import check_magic
        check_magic(a.model)             # before any process starts around it
    a.model = a.model and os.path.abspath(a.model)
    config = config_of(a, ServeConfig)           # validated, with the environment's knobs
    config = dataclasses.replace(config, threads=config.budget)
    check_context(config.model, config.context)
    address = _join(a.address)
    svc = _service()
    if svc is not None:
        d = ray.get(svc.describe.remote(), timeout=30)
        print(f"socllm: a service is already running ({d['model']}, "
              f"{d['frontends'].get('http', 'no HTTP')}); `socllm stop` removes it")
        return 0
    listens = _check_http(config) if config.http_port else None
    # the config travels as the argument: its knobs reach every actor, whatever environment
    # the cluster's processes have (runtime_env only sizes the libraries' thread pools)
    svc = Service.options(name=NAME, namespace=NAMESPACE, lifetime="detached",
                          **ray_env_options(config.threads)).remote(config, bool(config.http_port))
    url = None
    try:
        if config.http_port:
            url = _deploy_beside(svc, config)
        d = ray.get(svc.ready.remote())
    except BaseException as e:
        if config.http_port:          # deployed, or partly (_undeploy leaves others' apps)
            _undeploy()
        _remove(svc)
        if isinstance(e, ray.exceptions.RayTaskError):
            raise ValueError(str(getattr(e, "cause", e)).splitlines()[0]) from None
        raise
    pl = d["placement"]
    if url:                 # `socllm generate` streams from here without Ray (actors/front/direct.py)
        from socllm.actors.front.direct import write_record
        write_record(address, {"url": url, "pid": d["pid"], "api_key": config.api_key is not None,
                               "model_path": d["model_path"], "plan": d["plan"], "precision": d["precision"],
                               "hcmp_share": d["hcmp_share"], "placement": {"prefill": pl["prefill"], "decode": pl["decode"]}})
    print(f"socllm: serving {d['model']} (plan {d['plan']}: decode on the {_on(pl['decode'])}, prefill "
          f"chunks on the {pl['prefill']}, {d['precision']}, context "
          f"{d['context']}, {d['max_seqs']} sequences, {d['kv_blocks']} KV blocks of "
          f"{d['block_rows']} rows, {d['kv_dtype']} K/V, policy {d['policy']}) in Ray namespace '{NAMESPACE}'")
    if url:
        key = "an API key (Authorization: Bearer)" if config.api_key else "no API key"
        print(f"socllm: OpenAI-compatible HTTP at {url}/v1, {key}")
        if config.api_key is None and listens not in _LOCAL:
            print(f"socllm: warning: HTTP listens on {listens} without an API key: anyone "
                  f"who reaches this port can use the model (set --api-key or SOCLLM_API_KEY)",
                  file=sys.stderr)
    print("socllm: `socllm status` shows what runs, `socllm stop` removes it")
    return 0


def _serve_http() -> tuple | None:
    """(host, port, its applications) of Ray Serve's HTTP proxy where Serve already runs in the
    cluster (another user's applications, or one left behind), else None. A controller that
    answers nothing here is an error, not "no Serve": Serve would ignore a new address."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.exceptions import RayServeException
    try:
        client = _get_global_client(raise_if_no_controller_running=False)
    except RayServeException:
        return None
    if client is None:
        return None
    http = client.http_config
    try:
        apps = ", ".join(sorted(serve.status().applications)) or "none"
    except Exception:
        apps = "unknown"
    return http.host, http.port, apps


_LOCAL = {"127.0.0.1", "localhost", "::1"}


def _same_host(serving: str | None, asked: str) -> bool:
    """Serve's proxy on `serving` answers at `asked`: the same name, both this machine's
    loopback, or Serve on every address."""
    return serving is not None and (serving == asked or serving in ("0.0.0.0", "::")
                                    or serving in _LOCAL and asked in _LOCAL)


def _check_http(config):
    """The HTTP front end can start where asked: Serve has one proxy per node, set when Serve
    starts, so where Serve already runs socllm's ingress joins it on its host and port (Serve
    would ignore others and serve there all the same); else the port must be free. -> the
    host the proxy listens on (Serve's, where it runs)."""
    host, port = config.http_host, config.http_port
    running = _serve_http()
    if running is None:
        if not _port_free(host, port):
            raise ValueError(f"port {port} on {host} is in use (choose --http-port)")
        return host
    on, at, apps = running
    if on is None:
        raise ValueError(f"Ray Serve already runs in this cluster without HTTP (applications: "
                         f"{apps}): add --http-port 0 for none")
    if at != port or not _same_host(on, host):
        raise ValueError(f"Ray Serve already runs in this cluster with its HTTP proxy on {on}:{at} "
                         f"(applications: {apps}), and one Serve has one HTTP address: add "
                         f"--http-port {at}" + ("" if _same_host(on, host) else f" --http-host {on}")
                         + " to join it, or --http-port 0 for no HTTP")
    return on


def _deploy_beside(svc, config) -> str:
    """The HTTP front end (Ray Serve's proxy and the ingress), started while the service loads
    and warms the model (~5 s of a 16 s `socllm serve` on 2 cores, now beside it); the service
    takes its timings once this returns (Service.front_ends_up), whether it started or not."""
    from socllm.actors.front.http import deploy
    from socllm.models.gguf_file import model_path
    try:
        return deploy(config.http_host, config.http_port, config.api_key, config.max_body_mb,
                      os.path.basename(model_path(config.model)))
    finally:
        svc.front_ends_up.remote()


def _undeploy():
    try:
        from socllm.actors.front.http import undeploy
        undeploy()
    except Exception:
        pass


def _remove(svc):
    import ray

    from socllm.memory.arena import reap_orphans
    try:
        pids = _pids(ray.get(svc.status.remote(), timeout=30))
    except Exception:
        pids = []
    try:
        ray.get(svc.shutdown.remote(), timeout=60)
    except Exception:
        pass
    ray.kill(svc)
    _gone(pids)
    reap_orphans()


def _pids(st: dict) -> list[int]:
    """The service's process and its processors' (a status answer)."""
    return [p for p in [st.get("pid")] + [q.get("pid") for q in st.get("processors", [])] if p]


def _gone(pids: list[int], timeout: float = 60.0):
    """`ray.kill` returns before the process has ended: wait until the processes on this host have
    (so `stop` means stopped, and a `serve` right after it finds their memory free)."""
    import psutil
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def stop(a) -> int:
    from socllm.actors.front.cluster import NoCluster
    from socllm.actors.front.direct import remove_record
    try:
        address = _join(a.address)
    except NoCluster as e:
        print(f"socllm: {e}; nothing to stop")
        return 0
    remove_record(address)
    try:
        from socllm.actors.front.http import undeploy
    except ImportError:        # no ray[serve] in this install: it deployed no HTTP front end
        undeploy = None
    if undeploy is not None:
        undeploy()
    svc = _service()
    if svc is None:
        print("socllm: no service is running")
        return 0
    _remove(svc)
    print("socllm: stopped (Ray stays up)")
    return 0


def status(a) -> int:
    import ray
    _join(a.address)               # no cluster: NoCluster, exit status 2, what was tried
    svc = _service()
    if svc is None:
        print("socllm: no service is running (start one with `socllm serve`)", file=sys.stderr)
        return 1
    st = ray.get(svc.status.remote(), timeout=30)
    if a.json:
        print(json.dumps(st, indent=2))
        return 0
    r, kv = st["requests"], st["kv"]
    print(f"model      {st['model']}  (context {st['context']}, plan {st['plan']}, {st['precision']}, "
          f"policy {st['policy']}{'' if st.get('b_rf') is None else ', b_rf ' + str(st['b_rf'])})")
    print(f"http       {st['frontends'].get('http', '-')}")
    pl = st["placement"]
    timed = ", ".join(f"{k} {v:.0f} ms" for k, v in pl["chunk_ms"].items())
    why = {"timed": f"timed at start: {timed}; the npu must be {NPU_MARGIN}x faster", "cached": "auto, as timed at an earlier start",
           "no npu": "auto: no npu", "asked": "as asked",
           "policy": f"auto: the {st['policy']} policy's chunks run on the {pl['else']}"}[pl["from"]]
    fewer = f"of fewer than {pl['npu_from']} rows or " if pl.get("npu_from") else ""
    fewer += "past a prompt's start or " if pl.get("npu_later") is False else ""
    other = f" (chunks {fewer}it cannot take: the {pl['else']})" if pl["prefill"] != pl["else"] else ""
    print(f"plan       {st['plan']} ({why}): chunks of {st['prefill_chunk']} rows on the "
          f"{pl['prefill']}{other}, decode on the {_on(pl['decode'])}")
    for line in _decode_lines(pl):
        print(line)
    pre = st.get("preemption")
    if pre:
        npu = f", a whole npu chunk {pre['npu_chunk_ms']:.0f} ms" if pre["npu_chunk_ms"] else ""
        if pre.get("npu_first_ms"):
            npu += f", a prompt's first npu chunk {pre['npu_first_ms']:.0f} ms"
        stop = "stop between" if pre["proactive"].startswith("gpu spans") else "run as"
        print(f"preemption proactive chunks {stop} {pre['proactive']} (bound "
              f"{pre['bound_ms']:.0f} ms{npu}: the npu runs {pre['npu_runs']}); reactive ones run whole")
    q = st["queues"]
    classes = (f" (reactive {len(q['waiting_reactive'])}, proactive {len(q['waiting_proactive'])})"
               if "waiting_reactive" in q else "")
    print(f"requests   running {len(q['running'])}  waiting {len(q['waiting'])}{classes}  "
          f"finished {r['finished']}  cancelled {r['cancelled']}  failed {r['failed']}")
    print(f"kv         {kv['blocks_used']} of {kv['blocks']} blocks ({kv['block_rows']} rows each) "
          f"used; sequences {kv['sequences_used']} of {kv['sequences_max']}")
    if kv.get("prefix_cache"):
        print(f"prefix     {kv['hits']} of {kv['queries']} prompt tokens found in the cache "
              f"({100 * kv['hit_rate']:.1f} %); {kv['cached_blocks']} of at most "
              f"{kv['cached_blocks_max']} blocks kept, {kv['evicted_blocks']} evicted; "
              f"{kv['trimmed_blocks']} unused blocks' pages given back"
              + ("" if kv.get("idle_s") is None else
                 f"; {kv['dropped_blocks']} cached ones let go after {kv['idle_s']:g} s idle"
                 if kv["idle_s"] else "; kept while the service runs (--prefix-cache-idle-s 0)"))
    else:
        print("prefix     cache off (--no-prefix-cache)")
    sp = st.get("speculation") or {"mode": "off"}
    if sp["mode"] == "off":
        print("speculate  off (--speculate off)")
    else:
        rate = f"{sp['accepted']} of {sp['drafted']} drafted tokens accepted" + \
            (f", {1 + sp['accepted'] / sp['verify_steps']:.2f} tokens a verifying step" if sp["verify_steps"] else "")
        cost = " ".join(f"{n}:{ms:.1f}" for n, ms in enumerate(sp["step_ms"], 1))
        tree = sp.get("tree") or {}
        trees = f"; trees ({tree['ranks']} candidates a head): {tree['steps']} verified, " \
            f"{tree['side_accepted']} of {tree['side_tried']} second candidates accepted" \
            if tree.get("ranks", 1) > 1 else ""
        print(f"speculate  {sp['mode']} (at most {sp['draft_max']} drafted a step): {rate}{trees}; "
              f"step ms by rows {cost}")
    print(f"tokens/s   {st['tokens_per_s_1min']:.1f} (last minute)")
    lp = st["loop"]
    if lp["decode_steps"]:
        print(f"loop       {lp['decode_steps']} decode steps of {lp['decode_rows'] / lp['decode_steps']:.1f} "
              f"rows, {1e3 * lp['decode_s'] / lp['decode_steps']:.1f} ms each; {lp['prefill_chunks']} "
              f"prefill chunks, {lp['prefill_s']:.1f} s")
    for p in st["processors"]:
        print(f"{p['processor']:<10} {p.get('api') or ''} {p.get('device') or ''}: busy "
              f"{100 * p['busy_share']:.1f} %")
    if st["recoveries_total"]:
        last = st["recoveries"][-1]
        print(f"recovered  {st['recoveries_total']} processor actor death(s); the last: "
              f"{', '.join(last['processors'])}, back after {last['recovery_s']:.1f} s")
    print(f"memory     {st['memory_pss_mb']:.0f} MB PSS (all socllm processes)")
    print(f"uptime     {st['uptime_s']:.0f} s")
    return 0


def generate_served(a) -> int | None:
    """Run `socllm generate` on the running service; None when there is none (a private
    engine runs it). A cluster named with --address must answer; one found otherwise that does
    not (a cluster file left by a Ray that died) is passed over with a note."""
    from socllm.actors.front.cluster import NoCluster
    try:
        _join(a.address)
    except NoCluster as e:
        if a.address:
            raise
        if e.stale:
            print(f"socllm: no Ray cluster answers ({'; '.join(e.tried[1:])}): a private engine "
                  "runs this request", file=sys.stderr)
        return None
    svc = _service()
    if svc is None:
        return None
    import ray

    from socllm.actors.front.direct import same_service
    d = ray.get(svc.describe.remote())
    same_service(a, d["model_path"], d["plan"], d["precision"], d["hcmp_share"])
    return run_generate(svc, a, "service")


def generate_private(a, kv_mb: float, chunk: int) -> int:
    """`socllm generate` with no service (or --local): the same paged engine as `serve`'s, in
    this process's own Ray session (not detached), for this one request, stopped after it.
    kv_mb: the KV cache, sized for one sequence of the context; chunk: the prompt's rows a step."""
    from socllm.actors.front.llm import LLM
    from socllm.policies.config import ServeConfig
    c = a.config
    llm = LLM(c.model, context=c.context, threads=c.threads, precision=c.precision,
              plan=a.plan or "auto", kv_mb=kv_mb, policy="fcfs", warm=False,
              # off unless asked: this engine lives for one request and builds its kernels as
              # they are first used, so the first steps of each row count a draft would take
              # cost more than drafting saves (a cold `generate`: 41 against 119 tok/s)
              prefill_chunk=chunk, speculate=a.speculate or "off",
              # one request; its drafts are more rows of its decode steps (policies/drafting.py)
              max_seqs=1 if (a.speculate or "off") == "off" else 1 + (
                  ServeConfig.draft_max if a.draft_max is None else a.draft_max),
              **({"draft_max": a.draft_max} if a.draft_max is not None else {}),
              hcmp_share=c.hcmp_share, cache_dir=c.cache_dir,
              # per-layer NPU graphs, kept on disk, rather than a whole-model graph compiled
              # with its weights at every start (policies/buckets.py whole_graph): for one
              # request the compile costs more than the graph saves (2-core Xeon VM, `generate
              # --max-tokens 16`, later runs: a ~110-token prompt 4.1-4.5 s against 5.8-6.2, the
              # GPU chosen; ~350 tokens 5.0-5.2 against 7.2-7.4, hetero either way)
              whole_graph=False)
    try:
        out = run_generate(llm._service, a, "private")
    except BaseException:
        _quietly(llm.close)           # Ctrl-C: an error of the cleanup must not hide it
        raise
    llm.close()
    return out


def _quietly(close):
    """A cleanup while an exception (Ctrl-C) unwinds: its own error is printed, not raised, so the
    interrupt stays what the command reports (exit status 130)."""
    try:
        close()
    except Exception as e:
        print(f"socllm: while stopping: {type(e).__name__}: {e}", file=sys.stderr)


def run_generate(svc, a, where: str) -> int:
    """One request of `socllm generate` on a service (`where`: "service" or "private"),
    streamed to stdout (or one JSON object), its timings on stderr."""
    import ray

    from socllm.actors.front.client import Client
    from socllm.actors.front.direct import shaping
    client = Client(svc)
    params = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                  stop=a.stop, priority=a.priority, speculate=a.speculate, **shaping(a))
    if a.chat:
        rid = client.submit(messages=[{"role": "user", "content": a.prompt}], **params)
    else:
        rid = client.submit(prompt=a.prompt, **params)
    pieces = client.pieces(rid)
    try:
        if a.json:
            "".join(pieces)
        else:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n")
    except BaseException:
        _quietly(pieces.close)        # Ctrl-C: the request is cancelled in the service
        raise
    pieces.close()
    out = ray.get(svc.request.remote(rid))
    if a.json:
        print(json.dumps({k: out.get(k) for k in ("text", "tokens", "prompt_tokens", "plan", "placement",
                                                  "precision", "timings", "finish_reason")}
                         | {"prompt_tokens": out["prompt"]}))
    elif out.get("timings"):
        from socllm.actors.front.direct import timings_line
        t = out["timings"]
        print(timings_line(where, out["plan"], out["placement"], out["precision"], t["ttft_s"],
                           t["prefill_tok_s"], t["decode_tok_s"],
                           out["usage"].get("completion_tokens_details")), file=sys.stderr)
    return 0


def _decode_lines(pl: dict) -> list:
    """status's lines on what the decode steps run where it was timed: auto's batch sizes (GPU
    kernels against the NPU's batch graphs) and the hcmp plan's CPU share (ARCA)."""
    out = []
    if pl.get("batch_ms"):
        npu = set(pl.get("npu_batches") or ())
        sizes = " ".join(f"{b}:{t['gpu' if 'gpu' in t else 'cpu']:.1f}/{t['npu']:.1f}"
                         for b, t in sorted(pl["batch_ms"].items(), key=lambda x: int(x[0])))
        where = f"rows {', '.join(map(str, sorted(npu)))} on the npu, the rest" if npu else "every size"
        out.append(f"decode     {where} on the {pl['else']} (ms by rows, {pl['else']}/npu: {sizes})")
    h = pl.get("hcmp")
    if h:
        shares = ", ".join(f"{s:g} near position {p}" if len(h["bands"]) > 1 else f"{s:g}"
                           for p, s in h["bands"])
        tried = "; ".join(f"at {p}: " + " ".join(f"{s}:{t:.1f}" for s, t in m["shares"].items())
                          for p, m in h.get("ms", {}).items())
        src = {"asked": "--hcmp-share", "timed": "ARCA, timed at start",
               "cached": "ARCA, as timed at an earlier start"}[h["from"]]
        out.append(f"hcmp       cpu share of each linear's columns {shares} ({src}"
                   + (f"; ms by share {tried})" if tried else ")"))
    return out


def _on(program: str) -> str:
    """Where a plan's program runs, in words: a processor, or the processors a cut shares."""
    procs = PROCESSORS_OF.get(program)
    return f"{' + '.join(procs)} ({program})" if procs else program
