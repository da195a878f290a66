"""Token sampling: greedy, temperature, top-p (nucleus), seeded."""
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

    def __post_init__(self):
        if self.max_tokens < 1:
            raise BadParam("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise BadParam("temperature", f"must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise BadParam("top_p", f"must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:   # logits [V] f32
        if self.p.temperature == 0.0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.p.temperature
        prob = np.exp(z - z.max())
        prob /= prob.sum()
        if self.p.top_p < 1.0:
            order = np.argsort(-prob)
            keep = np.cumsum(prob[order]) - prob[order] < self.p.top_p   # always keeps the top one
            mask = np.zeros_like(prob, dtype=bool)
            mask[order[keep]] = True
            prob = np.where(mask, prob, 0.0)
            prob /= prob.sum()
        return int(self.rng.choice(len(prob), p=prob))
