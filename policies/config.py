"""Every knob of an engine and of the service, validated once (DESIGN.md §2: config is data).

`socllm generate` builds an EngineConfig and `socllm serve` a ServeConfig from their flags (whose
defaults are these fields) and the environment: `from_env` is the only reader of the SOCLLM_*
variables. The object then travels as an argument: the service, its engine and every processor
actor receive it, so a knob set where `socllm serve` runs reaches the actors of a Ray cluster
that `ray start` began earlier (whose processes never saw that environment).

    cfg = ServeConfig.from_env(max_seqs=8)      # SOCLLM_FUSE=0 etc. read here, once
    Service.remote(cfg)
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from dataclasses import fields as dataclasses_fields
from typing import ClassVar

from .agent import POLICIES
from .buckets import MAX_CHUNK
from .drafting import MAX_DRAFT
from .drafting import MODES as SPECULATE
from .sampling import BadParam
from .threads import machine_budget

# one default precision, served and local. q16: int16 activations (per 32-block) in the GPU's
# decode GEMVs for one or two rows, f32 for more (actors/gpu/kernels.py INT_ROWS_MAX), relative
# error ~2.5e-5 of f32: the oracle's greedy text on 48 of 48 prompts, perplexity equal to 1e-5.
# q8 (int8, llama.cpp's scheme) is within 0.2 % of llama.cpp's perplexity but agrees with its
# greedy text a little less often than f32 (16 vs 18 of 48), for 21-25 % more tok/s at 4-16
# streams on 2 cores, none at 1-2 (scripts/results/quality-2core-zen5*.txt)
DEFAULT_PRECISION = "q16"
# a serving decode step's linears: q16 int16 (Q4_1 / Q4_0 in weight tiles for any rows; other
# formats for one or two rows, f32 for more: actors/gpu/kernels.py INT_ROWS_MAX says why); q8 int8 activations per 32-block, llama.cpp's own
# for these weights (one row: the fused decode kernels; more: int8 weight tiles, cl/batch.cl);
# f32 the numpy oracle's path. Prefill chunks run in the same tiles (at q16 on a CPU's OpenCL; a
# GPU's keep the f32 GEMM, unmeasured against them), int16 at q16 (KL from the
# oracle 3e-8 over 20 windows of 256 tokens, 2.3x f32's tok/s), int8 at q8 (1.4e-3), f32 at f32
# (scripts/results/prefill-kl-2core-zen5.json).
SERVE_PRECISIONS = ("q8", "q16", "f32")
# a service's plans (policies/placement.py SERVE_PLANS; auto: HeteroLLM §4.3, timed at start)
SERVE_PLAN_NAMES = ("auto", "cpu", "gpu", "npu", "hetero", "tensor", "seqcut", "hybrid", "hcmp")
MAX_SEQS = 256
# field -> the environment variable that sets it (from_env), and its type there
ENV = {"threads": ("SOCLLM_THREADS", int), "fuse": ("SOCLLM_FUSE", bool),
       "whole_graph": ("SOCLLM_WHOLE_GRAPH", bool),
       "sleep_fraction": ("SOCLLM_SLEEP_FRACTION", float),
       "cl_discrete": ("SOCLLM_CL_DISCRETE", bool), "pocl_cpu": ("SOCLLM_POCL_CPU", str),
       "pocl_as_is": ("SOCLLM_POCL_AS_IS", bool),
       "api_key": ("SOCLLM_API_KEY", str),
       "moe_graphs": ("SOCLLM_MOE_GRAPHS", str), "moe_overflow": ("SOCLLM_MOE_OVERFLOW", str),
       "moe_group": ("SOCLLM_MOE_GROUP", int)}
# how the NPU runs a mixture-of-experts layer of a prefill chunk (actors/npu/experts.py):
# dense: one graph, every row through every expert; grouped: NPUMoE's capacity tiers and grouped
# expert graphs; per_expert: a graph per expert at the chunk's full size (NPUMoE's baseline).
# dense is the default because it measured fastest on this machine's OpenVINO CPU device: a
# 1,024-token prompt of the 16-expert MoEfied SmolLM2 in 729 ms, grouped 1,411, per_expert
# 1,174 (scripts/results/moe-2core-zen5.json): its whole-model graph keeps compressed constant
# weights, where the grouped units split the model into per-layer graphs and dispatch on the host
MOE_GRAPHS = ("dense", "grouped", "per_expert")
MOE_OVERFLOW = ("spill", "prune")


class ConfigError(BadParam):
    """One bad knob: `field` is its name (a field, or the variable that set it), `message` the
    rest of the line; the CLI says a field as the flag that sets it."""


def _need(ok: bool, name: str, what: str, value):
    if not ok:
        raise ConfigError(name, f"must be {what}, got {value!r}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None          # a GGUF file; None: the default model
    context: int = 2048               # tokens a sequence may hold (at most the model's)
    threads: int = 0                  # the machine's thread budget; 0: every core we may use
    precision: str = DEFAULT_PRECISION    # a request's default
    max_seqs: int = 1                 # sequences a serving step holds
    kv_mb: float = 0.0                # the paged KV cache, MB (0: one sequence of the context)
    # the environment's knobs (from_env; ENV names the variables)
    fuse: bool = True                 # decode through the fused kernels; False: op by op (profiles)
    whole_graph: bool = True          # a prompt's first NPU chunk as one graph (policies/buckets.py)
    sleep_fraction: float = 0.0       # HeteroLLM §4.2 predicted sleep (memory/ready.py: off here)
    cl_discrete: bool = False         # the GPU's copying path forced on a unified device (PoCL)
    pocl_cpu: str | None = None       # the CPU PoCL compiles for (actors/gpu/device.py)
    pocl_as_is: bool = False          # PoCL as it ships: no CPU named
    moe_graphs: str = "dense"         # MOE_GRAPHS: an MoE layer of a prefill chunk on the NPU
    moe_overflow: str = "spill"       # an expert's rows past its capacity: on the CPU (exact),
                                      # or pruned, the least salient first (NPUMoE §3.2)
    moe_group: int = 8                # experts a grouped graph (NPUMoE §4.2: 4, 8, 16)
    hcmp_share: float | None = None   # the hcmp plan: each linear's output columns on the CPU
                                      # actor (Ghidorah §III-B1); None: ARCA's, timed at start
                                      # (§III-C3, policies/arca.py) and cached
    cache_dir: str | None = None      # what socllm keeps between runs (auto plans); from_env:
                                      # $XDG_CACHE_HOME/socllm, else ~/.cache/socllm

    precisions: ClassVar[tuple] = SERVE_PRECISIONS

    def __post_init__(self):
        _need(self.model is None or isinstance(self.model, str) and self.model != "", "model",
              "a GGUF file", self.model)
        _need(_whole(self.context) and self.context >= 16, "context", "at least 16", self.context)
        _need(_whole(self.threads) and self.threads >= 0, "threads", "0 (every core) or more",
              self.threads)
        _need(self.precision in self.precisions, "precision",
              "one of " + ", ".join(self.precisions), self.precision)
        _need(_whole(self.max_seqs) and 1 <= self.max_seqs <= MAX_SEQS, "max_seqs",
              f"in [1, {MAX_SEQS}]", self.max_seqs)
        _need(_number(self.kv_mb) and self.kv_mb >= 0, "kv_mb", ">= 0", self.kv_mb)
        for name in ("fuse", "whole_graph", "cl_discrete", "pocl_as_is"):
            _need(isinstance(getattr(self, name), bool), name, "True or False", getattr(self, name))
        _need(_number(self.sleep_fraction) and 0 <= self.sleep_fraction <= 1, "sleep_fraction",
              "in [0, 1]", self.sleep_fraction)
        _need(self.hcmp_share is None or _number(self.hcmp_share) and 0 <= self.hcmp_share <= 1,
              "hcmp_share", "in [0, 1] (or None: timed)", self.hcmp_share)
        _need(self.cache_dir is None or isinstance(self.cache_dir, str) and self.cache_dir != "",
              "cache_dir", "a folder", self.cache_dir)
        _need(self.moe_graphs in MOE_GRAPHS, "moe_graphs", "one of " + ", ".join(MOE_GRAPHS),
              self.moe_graphs)
        _need(self.moe_overflow in MOE_OVERFLOW, "moe_overflow", "one of " + ", ".join(MOE_OVERFLOW),
              self.moe_overflow)
        _need(_whole(self.moe_group) and 1 <= self.moe_group <= 64, "moe_group", "in [1, 64]",
              self.moe_group)
        _need(self.pocl_cpu is None or isinstance(self.pocl_cpu, str) and self.pocl_cpu != "",
              "pocl_cpu", "a CPU name", self.pocl_cpu)

    @property
    def budget(self) -> int:
        """Threads for this machine's processors: `threads`, else one per core we may use."""
        return self.threads or machine_budget()

    @classmethod
    def from_env(cls, env=None, **fields):
        """The config of these fields, with the knobs they leave out read from `env`
        (os.environ) where set: the one place socllm reads its SOCLLM_* variables. A bad value
        raises ConfigError naming the variable."""
        env = os.environ if env is None else env
        if fields.get("cache_dir") is None:
            fields["cache_dir"] = os.path.join(env.get("XDG_CACHE_HOME") or
                                               os.path.expanduser("~/.cache"), "socllm")
        mine = {f.name for f in dataclasses_fields(cls)}
        read = {f: _parse(var, env[var], kind) for f, (var, kind) in ENV.items()
                if f in mine and f not in fields and env.get(var, "") != ""}
        try:
            return cls(**read, **fields)
        except ConfigError as e:
            if e.field in read:        # said as the variable, with its text
                var = ENV[e.field][0]
                what = e.message.rsplit(", got ", 1)[0]
                shown = "'<hidden>'" if e.field == "api_key" else repr(env[var])
                raise ConfigError(var, f"{what}, got {shown}") from None
            raise


def _parse(var: str, text: str, kind: type):
    """One variable's text as its field's type: booleans are 0 or 1."""
    if kind is bool:
        if text not in ("0", "1"):
            raise ConfigError(var, f"must be 0 or 1, got {text!r}")
        return text == "1"
    if kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            raise ConfigError(var, f"must be {'a whole number' if kind is int else 'a number'}, "
                                   f"got {text!r}") from None
        if kind is int and value < 1:
            raise ConfigError(var, f"must be at least 1, got {text!r}")
        return value
    return text


@dataclass(frozen=True)
class ServeConfig(EngineConfig):
    """`socllm serve`'s: an engine's knobs (with a service's defaults) and the service's own."""
    max_seqs: int = 16
    kv_mb: float = 512
    policy: str = "agent"             # scheduling (policies/agent.py POLICIES)
    plan: str = "auto"                # what runs decode batches and prefill chunks (SERVE_PLAN_NAMES)
    prefill_chunk: int = 128          # prompt rows a step: others' decode steps run between chunks
    prefix_cache: bool = True         # reuse the K/V of prompt blocks computed before (memory/blocks)
    # the most K/V the prefix cache keeps that no request holds, MB; the KV cache's other unused
    # pages go back to the OS (memory/blocks.py trim)
    prefix_cache_mb: float = 128
    # seconds the service stays idle (no request running or waiting) before the prefix cache's
    # blocks go, their K/V pages back to the OS with every free block's (Ollama's keep_alive is
    # 5 minutes for a whole model); 0: kept while the service runs
    prefix_cache_idle_s: float = 300.0
    # a running request whose text nobody has asked for this long (no poll open, none returned
    # since) has lost its client: a Python driver that died, or an HTTP disconnect that Serve's
    # proxy did not pass on (actors/front/http.py). Clients poll continuously (each poll within 10 s).
    abandon_s: float = 30.0
    # build every kernel and graph the requests may need at start (a service); False: the first
    # request builds what it uses (`socllm generate`'s private engine: one request)
    warm: bool = True
    http_host: str = "127.0.0.1"      # the OpenAI-compatible endpoint (this device only)
    http_port: int = 8000             # 0: no HTTP
    # HTTP requires `Authorization: Bearer <api_key>` where set (/health stays open); never shown
    api_key: str | None = field(default=None, repr=False)
    max_body_mb: float = 4.0          # a larger HTTP body is refused (413) before it is read whole
    max_waiting: int = 256            # requests waiting to start; one more is refused (429)
    # speculative decoding (policies/drafting.py): auto drafts (n-gram lookup, else the model's
    # draft heads where it has some) where the measured step costs and the acceptance so far say
    # it pays; lookup drafts whenever the lookup finds a continuation; heads only from the heads;
    # off never. A request's speculate field chooses for it, unless this is off.
    speculate: str = "auto"
    draft_max: int = 8                # tokens one sequence drafts in a step, at most
    # the draft heads' candidates per head: 2 verifies a tree of each head's two likeliest tokens
    # (its nodes chosen best first, policies/drafting.py Tree), 1 a chain of the likeliest
    draft_ranks: int = 2

    def __post_init__(self):
        super().__post_init__()
        _need(self.kv_mb > 0, "kv_mb", "> 0", self.kv_mb)
        _need(isinstance(self.warm, bool), "warm", "True or False", self.warm)
        _need(isinstance(self.prefix_cache, bool), "prefix_cache", "True or False", self.prefix_cache)
        _need(_number(self.prefix_cache_mb) and self.prefix_cache_mb >= 0, "prefix_cache_mb", ">= 0",
              self.prefix_cache_mb)
        _need(_number(self.prefix_cache_idle_s) and self.prefix_cache_idle_s >= 0,
              "prefix_cache_idle_s", ">= 0", self.prefix_cache_idle_s)
        _need(self.policy in POLICIES, "policy", "one of " + ", ".join(POLICIES), self.policy)
        _need(self.plan in SERVE_PLAN_NAMES, "plan", "one of " + ", ".join(SERVE_PLAN_NAMES), self.plan)
        _need(_whole(self.prefill_chunk) and 1 <= self.prefill_chunk <= MAX_CHUNK, "prefill_chunk",
              f"in [1, {MAX_CHUNK}]", self.prefill_chunk)
        _need(_number(self.abandon_s) and self.abandon_s > 0, "abandon_s", "> 0", self.abandon_s)
        _need(isinstance(self.http_host, str) and self.http_host != "", "http_host", "a host",
              self.http_host)
        _need(_whole(self.http_port) and 0 <= self.http_port <= 65535, "http_port",
              "in [0, 65535]", self.http_port)
        _need(self.api_key is None or isinstance(self.api_key, str) and self.api_key.strip() == self.api_key != "",
              "api_key", "a non-empty string without spaces at its ends", "<hidden>")
        _need(_number(self.max_body_mb) and self.max_body_mb > 0, "max_body_mb", "> 0", self.max_body_mb)
        _need(_whole(self.max_waiting) and self.max_waiting >= 1, "max_waiting", ">= 1", self.max_waiting)
        _need(self.speculate in SPECULATE, "speculate", "one of " + ", ".join(SPECULATE), self.speculate)
        _need(_whole(self.draft_max) and 1 <= self.draft_max <= MAX_DRAFT, "draft_max",
              f"in [1, {MAX_DRAFT}]", self.draft_max)
        _need(_whole(self.draft_ranks) and 1 <= self.draft_ranks <= 4, "draft_ranks", "in [1, 4]",
              self.draft_ranks)
