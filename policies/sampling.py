"""Token sampling: greedy, temperature, top-k, top-p (nucleus), min-p, seeded; the repetition
penalty (vLLM's and llama.cpp's), OpenAI's frequency and presence penalties and logit bias on the
logits first; the chosen token's log-probability and the top alternatives' (logprobs) from the
distribution the sampler draws from at temperature 1.

The order is vLLM's: penalties and bias on the logits, then temperature, then top-k and top-p,
then min-p on what is left. Greedy decoding takes the top token of the penalised logits (top-k,
top-p and min-p never remove it)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class BadParam(ValueError):
    """One bad parameter: `field` its name, `message` the rest of the line. Each front end says
    the field in its caller's terms (the CLI as its flag, HTTP and Python as the field)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field, self.message = field, message

    def __reduce__(self):           # pickled as its two parts (a Ray actor raises it to callers)
        return type(self), (self.field, self.message)


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    frequency_penalty: float = 0.0        # minus this times a token's count in the text so far
    presence_penalty: float = 0.0         # minus this once a token is in the text
    logit_bias: dict | None = None        # token id -> added to its logit, in [-100, 100]
    logprobs: int | None = None           # None: none; k: the chosen token's and the top k's
    top_k: int = 0                        # keep the k likeliest tokens; 0 or -1: all
    min_p: float = 0.0                    # keep tokens at least this times the likeliest's probability
    repetition_penalty: float = 1.0       # a token of the prompt or the text so far: a positive
    #                                       logit divided by it, a negative one multiplied (1: off)
    min_tokens: int = 0                   # no end token (EOS, stop_token_ids) before this many
    stop_token_ids: list | None = None    # more token ids that end the text, as EOS does (vLLM's)
    prompt_logprobs: int | None = None    # None: none; k: each prompt token's (after the first)
    #                                       logprob and the top k's there, teacher-forced (vLLM's)

    def __post_init__(self):
        if _not_whole(self.max_tokens) or self.max_tokens < 1:
            raise BadParam("max_tokens", f"must be a whole number >= 1, got {self.max_tokens!r}")
        if _not_number(self.temperature) or not 0.0 <= self.temperature <= 100:
            raise BadParam("temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        if _not_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise BadParam("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (_not_whole(self.seed) or self.seed < 0):
            raise BadParam("seed", f"must be a whole number >= 0, got {self.seed!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise BadParam(name, f"must be a number in [-2, 2], got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise BadParam("top_k", f"must be a whole number >= 1 (0 or -1: off), got {self.top_k!r}")
        if _not_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise BadParam("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if _not_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise BadParam("repetition_penalty", f"must be a number in (0, 10] (1: off), got "
                                                 f"{self.repetition_penalty!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise BadParam("min_tokens", f"must be a whole number in [0, max_tokens], got {self.min_tokens!r}")
        if self.stop_token_ids is not None and not (isinstance(self.stop_token_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids)):
            raise BadParam("stop_token_ids", "must be a list of token ids")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _token_id(k) is not None and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and -100 <= v <= 100 for k, v in self.logit_bias.items()):
                raise BadParam("logit_bias", "must map token ids to numbers in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)
                                  or not 0 <= v <= MAX_LOGPROBS):
                raise BadParam(name, f"must be a whole number of top tokens in [0, {MAX_LOGPROBS}]")


MAX_LOGPROBS = 20                 # OpenAI's (and vLLM's default) most top_logprobs


def _entry(logits: np.ndarray, tok: int, k: int) -> tuple:
    """(tok, its logprob, [(id, logprob)] of the k likeliest, likeliest first) from logits [V]."""
    z = logits.astype(np.float64)
    lse = z.max() + np.log(np.exp(z - z.max()).sum())
    top = np.argpartition(-z, k)[:k] if k else np.empty(0, int)
    top = top[np.argsort(-z[top])]
    return tok, float(z[tok] - lse), [(int(t), float(z[t] - lse)) for t in top]


def _not_number(v) -> bool:
    return isinstance(v, bool) or not isinstance(v, (int, float)) or v != v


def _not_whole(v) -> bool:
    return isinstance(v, bool) or not isinstance(v, (int, np.integer))


def _token_id(k) -> int | None:
    """A logit_bias key: an id, or its text in JSON ("42")."""
    try:
        return int(k) if not isinstance(k, bool) and int(k) >= 0 else None
    except (TypeError, ValueError):
        return None


class Sampler:
    def __init__(self, params: SamplingParams, prompt=(), ends=()):
        """prompt: the request's prompt ids (the repetition penalty counts them); ends: the ids
        that end the text besides stop_token_ids (the model's EOS), held back for min_tokens."""
        self.p = params
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict = {}                 # token -> times chosen (the penalties)
        self.bias = {_token_id(k): float(v) for k, v in (params.logit_bias or {}).items()}
        self.logprobs: list = []               # per token chosen: (id, logprob, [(id, logprob)])
        self.prompt_logprobs: list = []        # prompt token j + 1's, the same (prompt_logprobs)
        self.repeat = params.repetition_penalty != 1.0
        self.seen = set(int(t) for t in prompt) if self.repeat else set()   # prompt and text
        self.seen_ids = None                   # self.seen as an array, made again when it grows
        self.ends = np.array(sorted({*ends, *(params.stop_token_ids or ())}), np.int64)
        self.drawn = 0                         # tokens sampled so far (min_tokens)
        self.penalised = bool(params.frequency_penalty or params.presence_penalty)
        self.shaped = bool(self.penalised or self.bias or self.repeat)

    def __call__(self, logits: np.ndarray) -> int:   # logits [V] f32
        if self.shaped or self.drawn < self.p.min_tokens and len(self.ends):
            logits = self._shape(logits)
        tok = self._draw(logits)
        if self.p.logprobs is not None:
            self._log(logits, tok)
        if self.penalised:
            self.counts[tok] = self.counts.get(tok, 0) + 1
        if self.repeat and tok not in self.seen:
            self.seen.add(tok)
            self.seen_ids = None
        self.drawn += 1
        return tok

    def _shape(self, logits: np.ndarray) -> np.ndarray:
        """The repetition penalty, OpenAI's penalties and bias, on a copy (the logits are the pool's)."""
        out = logits.astype(np.float32, copy=True)
        p = self.p
        if self.seen:
            if self.seen_ids is None:
                self.seen_ids = np.fromiter(self.seen, np.int64, len(self.seen))
            ids = self.seen_ids[self.seen_ids < len(out)]
            v = out[ids]
            out[ids] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        for tok, n in self.counts.items():
            out[tok] -= n * p.frequency_penalty + p.presence_penalty
        for tok, b in self.bias.items():
            if tok < len(out):
                out[tok] += b
        if self.drawn < p.min_tokens:
            held = self.ends[self.ends < len(out)]
            kept = out[held].copy()
            out[held] = -np.inf
            if not np.isfinite(out).any():     # nothing else allowed (a grammar's end): end
                out[held] = kept
        return out

    def _log(self, logits: np.ndarray, tok: int):
        self.logprobs.append(_entry(logits, tok, self.p.logprobs))

    def log_prompt(self, logits: np.ndarray, tok: int):
        """The prompt's next token `tok` as the model saw it from these logits [V] (the row
        before it, teacher-forced): its logprob and the top prompt_logprobs' (the model's
        distribution: no penalty, bias or temperature), and its rank there (1: the likeliest;
        vLLM's: one more than the tokens strictly likelier)."""
        rank = 1 + int((logits > logits[tok]).sum())
        self.prompt_logprobs.append((*_entry(logits, tok, self.p.prompt_logprobs), rank))

    def _draw(self, logits: np.ndarray) -> int:
        if self.p.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.p.temperature
        if 0 < self.p.top_k < len(z):
            cut = np.partition(z, -self.p.top_k)[-self.p.top_k]
            z = np.where(z >= cut, z, -np.inf)     # ties at the cut all stay (vLLM's too)
        prob = np.exp(z - z.max())
        prob /= prob.sum()
        if self.p.top_p < 1.0:
            order = np.argsort(-prob)
            keep = np.cumsum(prob[order]) - prob[order] < self.p.top_p   # always keeps the top one
            mask = np.zeros_like(prob, dtype=bool)
            mask[order[keep]] = True
            prob = np.where(mask, prob, 0.0)
            prob /= prob.sum()
        if self.p.min_p > 0.0:
            prob = np.where(prob >= self.p.min_p * prob.max(), prob, 0.0)
            prob /= prob.sum()
        return int(self.rng.choice(len(prob), p=prob))
