"""socllm.LLM: the service's paged engine for offline batches, in the shape of `vllm.LLM`.

    import socllm
    with socllm.LLM(precision="f32") as llm:                # ServeConfig's knobs as keywords
        outs = llm.generate(["The capital of France is", "def fib(n):"], max_tokens=32)
        print(outs[0].text, outs[0].finish_reason, outs[0].usage)
        scored = llm.generate("Some text to score", max_tokens=1, prompt_logprobs=0)
        replies = llm.chat([[{"role": "user", "content": "Hi"}]])

It is the engine `socllm serve` runs (the same Service actor, scheduler, paged KV cache and
kernels), owned by this process: not detached and not named, so it ends with this process or
with close(), and a `socllm serve` beside it is not disturbed. Every prompt of a batch is
submitted at once, so continuous batching runs them together; their pieces are read
concurrently, so none is abandoned while another is read. Without a Ray running here, a private
one is started, and close() stops it.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
from contextlib import aclosing


@dataclasses.dataclass
class Completion:
    """One prompt's result: its text (stop text left out), why it ended ("stop" | "length"),
    and its token counts (prompt_tokens, completion_tokens, total_tokens). Where asked
    (logprobs=k, prompt_logprobs=k, as vLLM's SamplingParams): each reply token's, and each
    prompt token's (the first's None), as {token, logprob, bytes, top_logprobs: [{token,
    logprob, bytes}]} (the prompt's also with id and rank)."""
    text: str
    finish_reason: str
    usage: dict
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class LLM:
    def __init__(self, model: str | None = None, **knobs):
        """model: a GGUF file or a packaged model's name (None: the default); knobs: any field of
        ServeConfig but the HTTP ones (context, max_seqs, kv_mb, precision, policy, prefill,
        ...), validated before anything starts."""
        import ray

        from socllm.models.gguf_file import model_path
        from socllm.policies.config import ServeConfig
        from socllm.actors.front.cluster import ray_env_options
        from socllm.actors.front.client import Client
        from socllm.actors.front.cluster import ensure_ray
        from socllm.actors.service import Service
        bad = {"http_host", "http_port"} & set(knobs)
        if bad:
            raise ValueError(f"socllm.LLM serves no HTTP: {', '.join(sorted(bad))} do not apply")
        names = {f.name for f in dataclasses.fields(ServeConfig)} - {"http_host", "http_port", "model"}
        if set(knobs) - names:
            raise ValueError(f"socllm.LLM has no setting {', '.join(sorted(set(knobs) - names))} "
                             f"(it takes {', '.join(sorted(names))})")
        path = model_path(model) if model is not None else None
        config = ServeConfig.from_env(model=path, http_port=0, **knobs)
        config = dataclasses.replace(config, threads=config.budget)
        # what close() stops; at the program's exit too, if nobody closed it (a pool's shared
        # memory outlives a process Ray kills): registered after Ray's own exit hook, so it runs
        # first, and holding no reference to this object, which may be dropped before
        self._own = _Owned(ensure_ray(config.threads))
        atexit.register(self._own.stop)
        try:
            self._own.service = Service.options(**ray_env_options(config.threads)).remote(config)
            self.describe = ray.get(self._service.ready.remote())
        except BaseException:
            self.close()
            raise
        self._client = Client(self._service)

    @property
    def _service(self):
        return self._own.service

    # -- the API -------------------------------------------------------------------------------
    def generate(self, prompts, **params) -> list[Completion]:
        """The continuation of each prompt (a string or a list of them), in order. params: as
        socllm.connect()'s generate (max_tokens, temperature, top_p, seed, stop, priority, ...)."""
        return self._batch([dict(prompt=p, **params) for p in _listed(prompts, str)])

    def chat(self, conversations, **params) -> list[Completion]:
        """The assistant's reply to each conversation (a list of messages, or a list of them),
        through the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self._batch([dict(messages=m, **params) for m in _listed(conversations, list)])

    def embed(self, inputs, pooling: str = "mean") -> list:
        """The embedding of each input (a string, token ids, or a list of those), in order: its
        rows' final hidden states pooled ("mean" or "last"), L2-normalized (list of floats)."""
        if self._service is None:
            raise RuntimeError("this socllm.LLM is closed")
        return self._client.embed(inputs, pooling)

    def status(self) -> dict:
        """The engine's status (as `socllm status --json` shows a service's)."""
        import ray
        return ray.get(self._service.status.remote())

    def close(self):
        """Stop the engine (its actors and pool) and the private Ray, if this started it."""
        self._own.stop()
        atexit.unregister(self._own.stop)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- inside --------------------------------------------------------------------------------
    def _batch(self, requests: list) -> list[Completion]:
        if self._service is None:
            raise RuntimeError("this socllm.LLM is closed")
        return asyncio.run(self._all(requests))

    async def _all(self, requests: list) -> list[Completion]:
        # all queued at once: an offline batch is not held to the service's waiting bound
        rids = [await self._client.asubmit(**r, queue_bound=False) for r in requests]
        return list(await asyncio.gather(*(self._one(rid) for rid in rids)))

    async def _one(self, rid: str) -> Completion:
        from socllm.actors.front.client import _raise_unless_finished
        pieces, lps, out = [], None, None
        async with aclosing(self._client.apolls(rid)) as polls:
            async for out in polls:
                pieces += out["pieces"]
                if "logprobs" in out:
                    lps = (lps or []) + out["logprobs"]
        _raise_unless_finished(rid, out)
        return Completion("".join(pieces), out["finish_reason"], out["usage"], lps,
                          out.get("prompt_logprobs"))


class _Owned:
    """An LLM's engine (its Service actor) and whether it started the private Ray."""

    def __init__(self, started_ray: bool):
        self.service, self.started_ray = None, started_ray

    def stop(self):
        import ray
        if self.service is not None:
            try:
                ray.get(self.service.shutdown.remote(), timeout=120)
            except Exception:
                pass
            ray.kill(self.service)
            self.service = None
        if self.started_ray:
            from socllm.actors.front.cluster import stop_ray
            stop_ray()
            self.started_ray = False


def _listed(items, kind) -> list:
    """One item or a list of them -> a list, each checked to be `kind`."""
    items = [items] if isinstance(items, kind) and kind is str else items
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError("give one prompt or a non-empty list of them" if kind is str else
                         "give one conversation (a list of messages) or a non-empty list of them")
    for x in items:
        if not isinstance(x, kind):
            raise ValueError(f"each item must be a {kind.__name__}, got {type(x).__name__}")
    return list(items)
