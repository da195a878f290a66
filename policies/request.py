"""A request and its life in the request table (Agent.xpu §4.1): pure data, no Ray.

    waiting -> prefilling -> decoding -> finished
          \\-> cancelled   (the client left, or asked)        \\-> failed (an error, said once)

The table entry keeps what the paper's request manager keeps: id, state, priority class, prompt
and generated tokens, sampling parameters, KV held, and the arrival / first token / finish times.
A Sequence (nano-vllm's noun) adds what serving it takes: its sampler, its text's decoder and stop
strings, the pieces a client has yet to read and how they are told, its row of the block tables,
and the state of its client's polls: one object per request, no table keyed by its id.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .sampling import SamplingParams

PRIORITIES = ("reactive", "proactive")   # Agent.xpu §4.4: a person waits / background work
STATES = ("waiting", "prefilling", "decoding", "finished", "cancelled", "failed")
ENDED = ("finished", "cancelled", "failed")


class QueueFull(RuntimeError):
    """More requests wait than the service takes (ServeConfig.max_waiting): try again later (HTTP
    429 with Retry-After)."""


def check_priority(priority: str) -> str:
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    return priority


def check_stop(stop) -> tuple:
    """OpenAI's `stop`: a string or a list of up to 4 non-empty strings."""
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > 4 or \
            not all(isinstance(s, str) and s for s in stop):
        raise ValueError("stop must be a non-empty string or a list of at most 4 of them")
    return tuple(stop)


@dataclass
class Request:
    id: int | str                         # the service's: an unguessable handle (service.py)
    prompt: list                          # token ids [n_prompt]
    params: SamplingParams
    priority: str = "proactive"
    stop: tuple = ()                      # stop strings: the text ends before the first one
    ignore_eos: bool = False              # generate max_tokens whatever the model says (benchmarks)
    state: str = "waiting"
    tokens: list = field(default_factory=list)    # generated ids, stop token included
    text: str = ""                        # text a client may see (stop token and strings cut)
    finish_reason: str | None = None      # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    blocks: list = field(default_factory=list)    # KV block table (memory/blocks.py)
    names: list = field(default_factory=list)     # its full blocks' prefix-cache names, in order
    computed: int = 0                     # rows of prompt + tokens whose K/V are in the cache
    # rows after those whose K/V a draft tree's step wrote away from their positions (an accepted
    # path off the tree's chain, policies/drafting.py Tree): the next decode step feeds them again
    lag: int = 0
    cached: int = 0                       # prompt rows found in the prefix cache at admission
    arrival: float = field(default_factory=time.monotonic)
    prefill_start: float | None = None   # its first prefill chunk began (preemption latency)
    arrived_during: str = ""              # what the service's loop was running when it arrived
    first_token: float | None = None
    last_token: float | None = None       # its latest token (the agent policy's aging)
    finish: float | None = None
    embed: str | None = None              # "mean" | "last": an embedding of the prompt, no reply

    def __post_init__(self):
        check_priority(self.priority)
        self.stop = check_stop(self.stop)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def rows(self) -> int:
        """Rows the sequence has: prompt and generated tokens (the last one not yet fed)."""
        return len(self.prompt) + len(self.tokens)

    @property
    def ids(self) -> list:
        """Every row's token: prompt and generated."""
        return self.prompt + self.tokens

    @property
    def every_row(self) -> bool:
        """Each prompt row's output is asked for (prompt_logprobs, an embedding): no row may
        come from the prefix cache."""
        return self.params.prompt_logprobs is not None or self.embed is not None

    @property
    def prefilled(self) -> bool:
        """Its K/V are in the cache up to the last token: it decodes (feeds that token) next.
        A fresh request, or one preempted and resumed, prefills all its rows first."""
        return bool(self.tokens) and self.computed + self.lag == self.rows - 1

    def end(self, state: str, reason: str | None = None, error: str | None = None):
        if self.ended:
            return
        self.state, self.finish_reason, self.error = state, reason, error
        self.finish = time.monotonic()

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.tokens),
                "total_tokens": len(self.prompt) + len(self.tokens),
                "prompt_tokens_details": {"cached_tokens": self.cached}}


class StopText:
    """Text of a stream up to (never including) the first stop string.

    A piece that could be the start of a stop string is held back until the next piece shows
    it is not one (OpenAI's and llama.cpp's servers do the same)."""

    def __init__(self, stop: tuple):
        self.stop, self.held, self.hit = stop, "", None

    def feed(self, piece: str) -> str:
        """The text that is safe to show after `piece`; sets `hit` to the stop string once one
        appears (the first in the text; of two at one place, the first given)."""
        if self.hit:
            return ""
        text = self.held + piece
        cut, hit = min(((i, k) for k, i in enumerate(text.find(s) for s in self.stop) if i >= 0),
                       default=(-1, None))
        if cut >= 0:
            self.hit, self.held = self.stop[hit], ""
            return text[:cut]
        keep = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out


@dataclass(eq=False)
class Sequence(Request):
    """A request as the service serves it (actors/engine.py): pure data, no Ray."""
    sampler: object = None                # policies/sampling.Sampler(params): logits [V] -> id
    decoder: object = None                # the tokenizer's stream decoder: ids -> text pieces
    stops: StopText | None = None         # the text up to the first stop string
    pieces: list = field(default_factory=list)    # text pieces, in order: what polls hand out
    event: object = None                  # set (on the service's event loop) when it changes
    slot: int | None = None               # its row of the block tables while it runs
    polls: int = 0                        # its client's polls open now
    watchers: set = field(default_factory=set)    # the events of poll_many calls that wait on it
    last_poll: float = field(default_factory=time.monotonic)   # when the last one returned
    stop_asked: str | None = None         # "cancelled" | "abandoned": ended before the next step
    constraint: object = None             # policies/grammar.Constraint: the allowed next tokens
    tools: bool = False                   # its reply is models/tools.py's JSON (tool calls)
    speculate: str | None = None          # policies/drafting.py MODES; None: the service's
    prediction: object = None             # policies/drafting.Prediction: the reply it predicts (OpenAI)
    spec: object = None                   # policies/drafting.Speculation, once it drafts
    embedding: object = None              # embed: the pooled hidden states so far, then the vector
    embedded: int = 0                     # embed: prompt rows pooled so far

    __eq__, __hash__ = object.__eq__, object.__hash__     # one object per request: identity

    def __post_init__(self):
        super().__post_init__()
        if self.stops is None:
            self.stops = StopText(self.stop)

    def end(self, state: str, reason: str | None = None, error: str | None = None):
        """As Request's; what only its steps used goes with them: its grammar's parser (an
        LLMatcher, up to MBs: the table keeps ended requests for their polls), text decoder and
        prediction."""
        super().end(state, reason, error)
        self.constraint = self.decoder = self.prediction = None   # (a prediction's index: MBs)

    def usage(self) -> dict:
        out = super().usage()
        if self.spec is not None:
            out["completion_tokens_details"] = self.spec.usage()
        return out
