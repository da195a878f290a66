"""The Python client of a running socllm service (`socllm serve`).

    import socllm
    client = socllm.connect()
    text = client.generate("The capital of France is", max_tokens=16)
    for piece in client.generate("Once upon a time", stream=True): print(piece, end="")
    async for piece in client.agenerate("...", priority="reactive"): ...
    client.chat([{"role": "user", "content": "Name three colours."}])
    client.chat_message(messages, tools=[...])      # {"role", "content", "tool_calls"}

Every call takes max_tokens, temperature, top_p, seed, stop (a string or a list of up to 4) and
priority ("reactive": a person waits; "proactive": background work, the default). Leaving a
stream early (break, close, or cancelling the asyncio task) cancels the request at once.
"""
from __future__ import annotations

import asyncio
import contextvars
import secrets
import threading
import time
import weakref
from contextlib import aclosing, closing

import ray

from socllm.policies.request import ENDED

from socllm.actors.front.cluster import NAME, NAMESPACE

POLL_S = 10.0
HUB_EVERY_S = (0.02, 0.01, 0.05)   # a hub's calls at most every max(a, b * streams) <= c s


class PollHub:
    """Every stream of one event loop (an HTTP replica's; Client.polls runs every thread's on
    one loop) polled together: one poll_many call at a time for all of them instead of a Ray
    call per stream and piece, and while they make pieces at most every 20 ms (one or two
    streams) to 50 ms (five or more; never while one waits for its first piece). At 16 streams
    on 2 cores the calls per piece (their gRPC in the service, the replica and Serve's proxy,
    an SSE chunk each) took CPU from the kernels: decode steps of 31-34 ms, 23-25 with the hub
    (docs/measured.md)."""

    def __init__(self, service):
        self.svc, self.id = service, secrets.token_hex(8)
        self.asks: dict = {}          # id -> [seen pieces, seen logprobs]
        self.queues: dict = {}        # id -> asyncio.Queue of its answers (or an exception)
        self.task = None
        self.calling = False

    async def polls(self, rid: str):
        """Yields each answer for request rid until it ends."""
        queue = self.queues[rid] = asyncio.Queue()
        self.asks[rid] = [0, 0]
        if self.task is None or self.task.done():
            # in a context of its own: created in this stream's, Ray counts its poll_many calls as
            # children of this stream's request, and Serve's cancelling that request when its
            # client disconnects (recursively) cancelled the call every other stream waited on
            self.task = asyncio.get_running_loop().create_task(self._run(),
                                                               context=contextvars.Context())
        elif self.calling:
            self.svc.poke.remote(self.id)        # the call in flight does not ask for it
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out["state"] in ENDED:
                    return
        finally:
            self.asks.pop(rid, None)
            self.queues.pop(rid, None)

    async def _run(self):
        while self.asks:
            t0 = time.monotonic()
            asks = {rid: tuple(a) for rid, a in self.asks.items()}
            self.calling = True
            try:
                answers = await self.svc.poll_many.remote(self.id, asks, POLL_S)
            except ray.exceptions.TaskCancelledError:
                continue                          # the call, not the streams: call again
            except Exception as e:
                err = _cause(e) if isinstance(e, ray.exceptions.RayTaskError) else e
                for queue in self.queues.values():
                    queue.put_nowait(err)
                return
            finally:
                self.calling = False
            pieces = False
            for rid, out in answers.items():
                queue = self.queues.get(rid)
                if queue is None:
                    continue                      # it left meanwhile
                if out.get("missing"):
                    queue.put_nowait(KeyError(f"no request {rid}"))
                    continue
                self.asks[rid] = [out["seen"], out.get("seen_logprobs", 0)]
                pieces = pieces or bool(out["pieces"])
                queue.put_nowait(out)
            if pieces and all(a[0] for a in self.asks.values()):
                low, per, high = HUB_EVERY_S
                every = min(high, max(low, per * len(self.asks)))
                await asyncio.sleep(max(0.0, every - (time.monotonic() - t0)))


_hubs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # event loop -> {actor id: hub}
_polling: list = []           # the event loop of this process's synchronous streams, its thread


def _polling_loop() -> asyncio.AbstractEventLoop:
    """An event loop on a thread of its own, where Client.polls runs apolls for every thread."""
    with _polling_lock:
        if not _polling or not _polling[1].is_alive():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="socllm-polls", daemon=True)
            thread.start()
            _polling[:] = [loop, thread]
        return _polling[0]


_polling_lock = threading.Lock()


def _hub(service) -> PollHub:
    hubs = _hubs.setdefault(asyncio.get_running_loop(), {})
    key = service._actor_id.hex()
    if key not in hubs:
        hubs[key] = PollHub(service)
    return hubs[key]


class ServiceNotRunning(RuntimeError):
    pass


def connect(address: str | None = None) -> "Client":
    """Find the running service through Ray: this process's cluster if it has joined one, else
    the one at `address`, else the one actors/front/cluster.py finds (RAY_ADDRESS, which a `ray job`
    sets, else the cluster file `ray start` wrote)."""
    from socllm.actors.front.cluster import NoCluster, join
    try:
        join(address, NAMESPACE)
    except NoCluster as e:
        raise ServiceNotRunning(f"{e}, then `socllm serve`") from None
    try:
        return Client(ray.get_actor(NAME, namespace=NAMESPACE))
    except ValueError:
        raise ServiceNotRunning("no socllm service is running in this Ray cluster: "
                                "start it with `socllm serve`") from None


def _cause(e: ray.exceptions.RayTaskError) -> BaseException:
    """The exception the service raised (ValueError for bad input), not Ray's wrapper."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, (ValueError, KeyError, RuntimeError, TimeoutError)) else e


class RequestCancelled(RuntimeError):
    """The service ended a request this client was still reading (abandoned, or cancelled by
    another caller or by the service's shutdown): its text is cut short."""


def _raise_unless_finished(rid: str, out: dict):
    """A stream that the service ended without finishing it raises, never ends as if complete."""
    if out["state"] == "failed":
        raise RuntimeError(f"request {rid} failed: {out['error']}")
    if out["finish_reason"] == "abandoned":
        raise RequestCancelled(f"request {rid} was cancelled as abandoned: its text went "
                               f"unread for longer than the service's --abandon-s")
    if out["state"] == "cancelled":
        raise RequestCancelled(f"request {rid} was cancelled by the service before it finished")


async def _aclose_after(agen):
    """agen.aclose() once no step of it runs. A Ctrl-C that lands between submitting a step and
    holding its future leaves that step running behind the last, finished future; aclose() of a
    running async generator raises, and that error replaced the KeyboardInterrupt (exit 1, not
    130, one fresh-clone run in ~15)."""
    while agen.ag_running:
        await asyncio.sleep(0.005)
    await agen.aclose()


class Client:
    def __init__(self, service):
        self.service = service

    # -- requests ----------------------------------------------------------------------------
    def submit(self, **request) -> str:
        try:
            return ray.get(self.service.submit.remote(**request))
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None

    async def asubmit(self, **request) -> str:
        try:
            return await self.service.submit.remote(**request)
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None

    def cancel(self, rid: str) -> bool:
        return ray.get(self.service.cancel.remote(rid))

    def polls(self, rid: str):
        """Yields each poll's answer until the request ends (raising if it did not finish);
        leaving early cancels the request. apolls on this process's polling thread: the
        streams of every thread are polled together (PollHub)."""
        loop = _polling_loop()
        agen, fut, out = self.apolls(rid), None, None
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), loop)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    break
                yield out
            _raise_unless_finished(rid, out)
        finally:              # apolls' own `finally` cancels a request left before its end
            if fut is not None and not fut.done():
                fut.cancel()                  # interrupted while waiting (KeyboardInterrupt)
            else:                             # (a step may still run: below)
                asyncio.run_coroutine_threadsafe(_aclose_after(agen), loop).result()

    def pieces(self, rid: str):
        """Yields the request's text pieces; closing the generator early cancels it."""
        with closing(self.polls(rid)) as polls:
            for out in polls:
                self.last = out
                yield from out["pieces"]

    async def apolls(self, rid: str):
        """Yields each poll's answer (pieces, state, finish_reason, usage) until the request
        ends; leaving early (break, aclose() or the task cancelled) cancels the request. The
        streams of one event loop are polled together (PollHub)."""
        done = False
        try:
            async with aclosing(_hub(self.service).polls(rid)) as polls:
                async for out in polls:
                    done = out["state"] in ENDED
                    yield out
        finally:
            if not done:
                self.service.cancel.remote(rid)

    async def apieces(self, rid: str):
        async with aclosing(self.apolls(rid)) as polls:
            async for out in polls:
                for p in out["pieces"]:
                    yield p
                self.last = out
        _raise_unless_finished(rid, out)

    # -- the API -------------------------------------------------------------------------------
    def generate(self, prompt: str, stream: bool = False, **params):
        """The continuation of `prompt`: the whole text, or (stream=True) an iterator of pieces."""
        return self._run(stream, prompt=prompt, **params)

    def chat(self, messages: list, stream: bool = False, **params):
        """The assistant's reply to `messages`, through the model's own chat template."""
        return self._run(stream, messages=messages, **params)

    def chat_message(self, messages: list, **params) -> dict:
        """The assistant's reply as OpenAI's message: {"role", "content", "tool_calls"} (with
        tools=[...]: the calls it made, each {id, type, function: {name, arguments}}, and
        content None; without: its text and no calls)."""
        pieces = []
        for out in self.polls(self.submit(messages=messages, **params)):
            pieces += out["pieces"]
        text, said = "".join(pieces), out.get("message")
        if said is None:
            return {"role": "assistant", "content": text, "tool_calls": []}
        return {"role": "assistant", **said}

    def embed(self, inputs, pooling: str = "mean", **params) -> list:
        """The embedding of each input (a string, token ids, or a list of those), in order: its
        rows' final hidden states pooled ("mean" or "last"), L2-normalized."""
        batch = [inputs] if isinstance(inputs, str) or inputs and isinstance(inputs[0], int) else inputs
        if not isinstance(batch, (list, tuple)) or not batch:
            raise ValueError("give one input (text or token ids) or a non-empty list of them")
        try:      # queued at once: their rows share prefill chunks (actors/engine.py _prefill_embeds)
            rids = ray.get(self.service.submit_many.remote(
                [{**({"ids": x} if isinstance(x, list) else {"prompt": x}), "embed": pooling, **params}
                 for x in batch]))
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
        return [self._embedding(rid) for rid in rids]

    def _embedding(self, rid: str) -> list:
        out = None
        for out in self.polls(rid):
            pass
        return out["embedding"]

    def _run(self, stream: bool, **request):
        it = self.pieces(self.submit(**request))
        return it if stream else "".join(it)

    async def agenerate(self, prompt: str, **params):
        """Async iterator of the pieces of `prompt`'s continuation."""
        async for p in self.apieces(await self.asubmit(prompt=prompt, **params)):
            yield p

    async def achat(self, messages: list, **params):
        async for p in self.apieces(await self.asubmit(messages=messages, **params)):
            yield p

    def tokenize(self, prompt: str | None = None, messages: list | None = None,
                 add_special: bool = True) -> list:
        """The token ids a request with this prompt (or chat messages) starts from."""
        try:
            return ray.get(self.service.tokenize.remote(prompt, messages, add_special))
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None

    def detokenize(self, ids: list) -> str:
        """The text of these token ids."""
        try:
            return ray.get(self.service.detokenize.remote(ids))
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None

    def status(self) -> dict:
        return ray.get(self.service.status.remote())
