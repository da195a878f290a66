"""The pool and its actors: load a model into the pool, start the planner and the processor
actors, revive one that dies, tear it all down.

    with Pool(context=256) as eng:              # the default model
        out = eng.generate_ids(ids, plan="gpu", max_tokens=16)   # one sequence (tests, benchmarks)

The service (actors/service.py) drives its steps through actors/runner.py; so does
generate_ids, for one sequence at a time, on the same paged programs. The pool starts a local
Ray instance when none is running (and stops it on close) or joins the running one (`ray start
--head`; actors/front/cluster.py). It creates the pool, writes the weights into it once, starts the planner and the CPU,
GPU and NPU actors asked for, and tears all of it down on close, on errors and on Ctrl-C: no
actor, process or shared-memory segment is left behind.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import secrets
import time

import numpy as np
import ray

from socllm.graph.build import build_graph
from socllm.graph.hcmp import with_part_slots
from socllm.graph.liveness import assign_slots
from socllm.graph.store import ProgramStore
from socllm.memory.arena import Arena
from socllm.memory.blocks import BLOCK_ROWS
from socllm.memory.layout import KV_DTYPES, Control, plan_layout, write_weights
from socllm.memory.ready import ReadyWords
from socllm.models.chat import ChatTemplate, chat_prompt
from socllm.models.gguf_file import ModelError, file_digest, model_path, open_gguf, verify_default_model
from socllm.models.llama import load_config, load_weights, matrix_types
from socllm.models.tokenizer import Tokenizer
from socllm.policies.buckets import MAX_CHUNK, bucket_for
from socllm.policies.config import DEFAULT_PRECISION, SERVE_PRECISIONS, EngineConfig  # noqa: F401
from socllm.policies.placement import SERVE_PLANS, weight_problem
from socllm.policies.rowcut import load_profile
from socllm.policies.sampling import Sampler, SamplingParams

from socllm.actors.front.cluster import ensure_ray, ray_env_options, stop_ray
from socllm.actors.planner import Planner
from socllm.actors.processor import ProcessorActor



def _trim():
    """Give freed heap pages back to the OS (the repacked weights were ~100 MB)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _resolved(config: EngineConfig | None, fields: dict) -> EngineConfig:
    """The engine's config: `fields` over `config` or else over the environment's, with the
    machine's thread budget resolved here, once (every actor gets the same number)."""
    if config is None:
        config = EngineConfig.from_env(**fields)
    elif fields:
        config = dataclasses.replace(config, **fields)
    return dataclasses.replace(config, threads=config.budget)


class Pool:
    def __init__(self, config: EngineConfig | None = None, *,
                 processors_: tuple = ("cpu", "gpu", "npu"), n_layers: int | None = None,
                 reader=None, rowcut_profile: str | None = None,
                 kv_dtype: str = "f32", double_rows: int = 0, **fields):
        """config: every knob (policies/config.py), passed on to every actor; fields: some, over
        `config` or else EngineConfig.from_env(). rowcut_profile: the tensor plan's (default:
        policies/rowcut.PROFILE_PATH's, else an even cut). kv_dtype: the KV cache's elements
        (memory/layout.KV_DTYPES; "f16": paged programs on the GPU only). double_rows: the double
        activation buffer's rows (memory/layout.py; the service's prefill chunk), 0: none."""
        self._closed = True
        self.config = config = _resolved(config, fields)
        self.max_seqs, self.kv_mb, self.threads = config.max_seqs, config.kv_mb, config.threads
        self.kv_dtype, self.double_rows, self._actors, self.arena = kv_dtype, double_rows, [], None
        self.rowcut_profile = load_profile(rowcut_profile)
        reader = self._open(config.model, config.context, reader)
        self._started_ray = ensure_ray(self.threads)
        self.running, self._closed = None, False
        # a processor whose kernels cannot read every weight of this model is not started
        types = matrix_types(reader)
        self.skipped = {p: why for p in processors_ if p != "cpu"
                        for why in [weight_problem(p, types)] if why}
        processors_ = tuple(p for p in processors_ if p not in self.skipped)
        try:
            # the repacked weights live only until they are in the pool (no reference kept here)
            self._start(load_weights(reader, self.cfg), processors_, n_layers, reader)
            del reader
            _trim()
        except BaseException:
            self.close()
            raise

    def _open(self, model: str | None, context: int, reader=None):
        """The model's file (None: the default, checked; a packaged model's name: its file) and
        config, for a context it holds. -> its reader."""
        path = model_path(model)
        if model is None:
            verify_default_model(path)
        reader = reader or open_gguf(path)
        self.cfg = load_config(reader)
        if context > self.cfg.context_length:
            raise ModelError(f"context must be in [16, {self.cfg.context_length}], got {context}")
        self.context, self.model_path = context, path
        return reader

    def _read_text(self, reader):
        """The tokenizer and the chat template (~0.25 s of the default model's start: done while
        the processor actors' processes start)."""
        self.tokenizer = Tokenizer(reader)
        self.template = ChatTemplate.from_reader(reader)
        self.stop_ids = self.tokenizer.stop_ids()

    def _start(self, weights, procs, n_layers, reader):
        # named, so that the control actor looks them up by name: an actor handle among a
        # restartable actor's constructor arguments sits in the object store, and Ray warns that
        # the restart fails if that copy is lost
        tag = f"socllm-{secrets.token_hex(6)}"
        self._names = {"planner": f"{tag}-planner", **{p: f"{tag}-{p}" for p in procs}}
        self._n_layers_asked, self._planner, self._compiled, self._ids = n_layers, None, {}, 0
        lay = self._lay_out(weights, n_layers)
        del weights
        env = ray_env_options(self.threads)
        peers = {p: ProcessorActor.options(**env, name=self._names[p]).remote(
                     p, self.arena.name, lay.to_dict(), self.config)
                 for p in procs}
        self._actors += list(peers.values())
        self._read_text(reader)
        if self._planner is not None:
            ray.get(self._planner.set_layout.remote(lay.to_dict()))     # started beside them
        if "gpu" in peers and "npu" in peers and ray.get(peers["gpu"].info.remote()).get("discrete"):
            # a discrete GPU's KV cache lives in its memory: steps of one request must not move
            # between it and a processor writing the host's (auto would prefill on the NPU)
            self._actors.remove(peers["npu"])
            ray.kill(peers.pop("npu"))
            self.skipped["npu"] = "the GPU is discrete: a request's steps stay on it (its KV cache " \
                                  "is in the GPU's memory, not in the pool the NPU writes)"
        self.peers, self.available = peers, set(peers)
        ray.get([a.pid.remote() for a in peers.values()])              # started and attached
        self.watches = {p: a.watch.remote() for p, a in self.processors().items()}
        self._runners: dict = {}      # (plan, precision, chunk) -> Runner (generate_ids)
        self._check_rowcut_profile()

    def _check_rowcut_profile(self):
        """A row-cut profile measured on another device would mislead the solver: an even cut
        instead."""
        if self.rowcut_profile is None or "gpu" not in self.peers:
            return
        if self.rowcut_profile.get("device") != ray.get(self.peers["gpu"].info.remote())["device"]:
            self.rowcut_profile = None
            if self._planner is not None:
                ray.get(self._planner.set_rowcut_profile.remote(None))

    def _lay_out(self, weights: dict, n_layers: int | None):
        """The pool laid out from the graph's slots and the weights, created and filled; the
        planner started if programs are to be compiled. -> the layout."""
        slots = _slots(build_graph(self.cfg, n_layers))
        # the final-normed hidden state's slot (the LM head's input): draft heads read it
        self.hidden_slot = hid = slots.assign.get("xf")
        slot_bytes = [slots.nbytes(i, MAX_CHUNK) for i in range(len(slots.sizes))]
        if n_layers is not None:      # a truncated model (tests): only the first layers' weights
            weights = {k: v for k, v in weights.items()
                       if not k.startswith("blk.") or int(k.split(".")[1]) < n_layers}
        self.n_layers = layers = self.cfg.n_layers if n_layers is None else n_layers
        kv_cols = self.cfg.n_kv_heads * self.cfg.head_dim
        double = (self.double_rows, [slots.nbytes(i, self.double_rows) for i in range(len(slots.sizes))]) \
            if self.double_rows else ()
        block_bytes = layers * 2 * BLOCK_ROWS * kv_cols * KV_DTYPES[self.kv_dtype]   # every layer's K, V
        self.layout = lay = plan_layout(
            weights, layers, kv_cols, slot_bytes, MAX_CHUNK, self.context, self.cfg.vocab,
            max(self.cfg.dim, self.cfg.ffn_dim), max_seqs=self.max_seqs,
            kv_blocks=int(self.kv_mb * 2**20 // block_bytes), block_rows=BLOCK_ROWS,
            kv_dtype=self.kv_dtype, double=double)
        lay.hidden = [lay.slots[hid], 4 * self.cfg.dim * self.max_seqs] if hid is not None else []  # GPU: down
        self.store = self._store(lay, n_layers)
        if self.store is None or not self.store.known():
            self.planner    # programs to compile: it builds its graph while the pool is filled
        self.arena = Arena.create(lay.size, lay.readonly_bytes)
        write_weights(self.arena.buf, lay, weights)
        self.words = ReadyWords(self.arena.buf[lay.words: lay.words + lay.n_words * 4])
        self.ctl = Control(self.arena.buf, lay)
        return lay

    def _store(self, lay, n_layers: int | None):
        """Compiled programs on disk (graph/store.py), for this code, model, layout and cuts."""
        c = self.config
        return None if c.cache_dir is None else ProgramStore(
            c.cache_dir, file_digest(self.model_path), n_layers, lay.to_dict(), self.rowcut_profile)

    # -- step programs: compiled by the planner actor, kept here and on disk ----------------------
    def program(self, key: tuple) -> tuple:
        """The paged program of key = (plan, all_rows, buffer, bucket) (policies/planner.py
        paged_program) -> (id, msgpack bytes, its processors). Compiled once per engine: from
        disk (graph/store.py: compiled by an earlier engine of the same code, model and pool
        layout), else by the planner actor, started for it if it is not running. Ids are this
        engine's: a processor keeps its programs by id."""
        if key not in self._compiled:
            got = self.store.get(key) if self.store is not None else None
            if got is None:
                _, blob, procs = ray.get(self.planner.paged_program.remote(*key))
                if self.store is not None:
                    self.store.put(key, blob, procs)
            else:
                blob, procs = got
            self._ids += 1
            self._compiled[key] = (self._ids, blob, list(procs))
        return self._compiled[key]

    @property
    def planner(self):
        """The planner actor (actors/planner.py), started when a program is not compiled yet."""
        if self._planner is None:
            self._planner = Planner.options(**ray_env_options(self.threads),
                                            name=f"{self._names['planner']}-{secrets.token_hex(3)}").remote(
                self.cfg, self._n_layers_asked, self.rowcut_profile)
            self._actors.append(self._planner)
            if self.arena is not None:        # the pool is laid out
                ray.get(self._planner.set_layout.remote(self.layout.to_dict()))
        return self._planner

    def release_planner(self) -> bool:
        """Stop the planner actor (~100 MB) once every program the plan runs is compiled and
        installed; a program asked for later starts it again. Returns whether one was running."""
        if self._planner is None:
            return False
        self._actors.remove(self._planner)
        ray.kill(self._planner)
        self._planner = None
        return True

    # -- one sequence at a time, on the service's paged programs (tests and benchmarks) --------
    def encode_prompt(self, prompt: str, chat: bool = False) -> list:
        if not prompt or not prompt.strip():
            raise ValueError("the prompt is empty")
        text = chat_prompt(self.template, prompt) if chat else prompt
        ids = self.tokenizer.encode(text, bos=self.tokenizer.add_bos)
        if len(ids) >= self.context:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.context}")
        return ids

    def runner(self, plan=None, precision=None, chunk: int = 0):
        """The runner (actors/runner.py) of a plan (policies/placement.py SERVE_PLANS; None:
        the GPU's, else the CPU's) at a precision, whose static NPU graphs take `chunk` rows."""
        from socllm.actors.runner import Runner
        plan = plan or ("gpu" if "gpu" in self.available else "cpu")
        if plan not in SERVE_PLANS:
            raise ValueError(f"unknown plan {plan!r} (choose from {', '.join(SERVE_PLANS)})")
        precision = precision or self.config.precision
        if precision not in SERVE_PRECISIONS:
            raise ValueError(f"unknown precision {precision!r} (choose from "
                             f"{', '.join(SERVE_PRECISIONS)})")
        key = (plan, precision, chunk)
        if key not in self._runners:
            self._runners[key] = Runner(self, plan, precision, chunk)
        return self._runners[key]

    def generate_ids(self, ids: list, plan=None, precision=None, ignore_eos: bool = False,
                     **sampling) -> dict:
        """One sequence: its prompt prefilled in one chunk (static NPU graphs: the bucket that
        holds it), then decoded a token a step, sampled as `sampling` says (SamplingParams).
        placement: the programs its prefill chunks and its decode steps ran on (the plan's, or
        the base processor's where the plan's could not take a chunk; "+"-joined if several)."""
        params = SamplingParams(**sampling)
        if not ids or len(ids) >= self.context:
            raise ValueError(f"a prompt of {len(ids)} tokens (the context holds {self.context})")
        chunk = bucket_for(min(len(ids), MAX_CHUNK))
        run = self.runner(plan, precision, chunk)
        before = dict(run.ran)
        ends = () if ignore_eos else self.stop_ids
        tokens, pre_s, dec_s = run.generate(ids, params.max_tokens, Sampler(params, ids, ends),
                                            (*ends, *(params.stop_token_ids or ())), chunk)
        # where the steps ran: the programs whose step counts grew ("seqcut chunk 300" ->
        # seqcut); a chunk the plan's program cannot take runs on the base processor
        ran = {phase: "+".join(sorted({k.split()[0] for k, n in run.ran.items()
                                      if k.split()[1] == phase and n > before.get(k, 0)}))
               for phase in ("chunk", "batch")}
        n_dec = len(tokens) - 1
        return {"tokens": tokens, "prompt_tokens": list(ids), "plan": run.plan,
                "placement": {"prefill": ran["chunk"] or run.chunk_on,
                              "decode": ran["batch"] or run.decode_on},
                "precision": run.precision,
                "timings": {"ttft_s": pre_s, "prefill_tok_s": len(ids) / max(pre_s, 1e-9),
                            "decode_tok_s": n_dec / dec_s if n_dec > 0 else 0.0}}

    def logits_after(self, ids: list, plan=None, precision=None) -> np.ndarray:
        """Teacher-forced logits [len(ids), V], one decode step a token."""
        return self.runner(plan, precision).logits_after(ids)

    def text(self, tokens: list) -> str:
        """The text of generated tokens; a stop token ends the text and is not part of it."""
        return self.tokenizer.decode([t for t in tokens if t not in self.stop_ids])

    def processors(self) -> dict:
        """name -> the processor actor."""
        return dict(self.peers)

    def info(self) -> list:
        """Each processor actor's info(); one that is being restarted says so."""
        out = []
        refs = {name: a.info.remote() for name, a in self.processors().items()}   # asked at once
        for name, ref in refs.items():
            try:
                out.append(ray.get(ref, timeout=10))
            except (ray.exceptions.RayError, TimeoutError) as e:
                out.append({"processor": name, "pid": None, "steps": 0, "busy_s": 0.0,
                            "error": f"unavailable ({type(e).__name__}): restarting"})
        return out

    def pids(self) -> list:
        pids = [os.getpid()]
        for ref in [a.pid.remote() for a in self._actors]:           # asked at once
            try:
                pids.append(ray.get(ref, timeout=10))
            except (ray.exceptions.RayError, TimeoutError):
                pass                     # being restarted
        return pids

    def release_kv(self, blocks: list):
        """These KV blocks' pages back to the OS (memory/blocks.py trim: no sequence holds them)."""
        self.arena.release(self.layout.kv_pages(blocks))

    def drop(self, name: str):
        """Stop a processor actor no plan uses any more (auto timed it and chose another)."""
        actor = self.peers.pop(name)
        self.watches.pop(name, None)
        self.available.discard(name)
        self._actors.remove(actor)
        ray.kill(actor)

    # -- a processor actor that died (Ray restarts it: actors/processor.py MAX_RESTARTS) -----------
    def lost(self) -> list:
        """Names of the processor actors whose process died since they were last revived (their
        pending watch() failed)."""
        refs = list(self.watches.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return [p for p, r in self.watches.items() if r in done]

    def revive(self, names: list, timeout_s: float = 60.0) -> float:
        """Waits until Ray has restarted these actors (their constructors attach the pool again)
        and watches them anew. Returns the seconds waited; raises if one is not back in time."""
        t0 = time.monotonic()
        for p in names:
            actor = self.processors()[p]
            while True:
                try:
                    ray.get(actor.pid.remote(), timeout=max(1.0, t0 + timeout_s - time.monotonic()))
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    if time.monotonic() > t0 + timeout_s:
                        raise RuntimeError(f"the {p} actor did not come back within {timeout_s:.0f} s")
                    time.sleep(0.2)
            self.watches[p] = actor.watch.remote()
        return time.monotonic() - t0

    # -- teardown ------------------------------------------------------------------------------
    def close(self):
        if self._closed:
            return
        self._closed = True
        for a in self._actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        self._actors = []
        if self.arena is not None:
            self.arena.unlink()
        if self._started_ray:
            stop_ray()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _slots(graph):
    """The graph's activation slots (graph/liveness.py), and graph/hcmp.py's parts'."""
    return with_part_slots(assign_slots(graph), graph)
