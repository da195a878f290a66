"""Constrained decoding: structured output and well-formed tool calls (DESIGN.md §5).

A request may carry a constraint: a JSON schema (`response_format` json_object / json_schema, or
the tools' call schema, models/tools.py) or a grammar (Lark or GBNF). llguidance (the mask library
llama.cpp, vLLM and SGLang also use) compiles it against the model's tokenizer and, at each step,
gives the set of tokens that keep the text inside the language as a bitmask [ceil(V/32)] int32.
The serving loop fills the masks of the next step's constrained rows on a CPU thread while the
processors run the step (actors/loop.py), then sets every other token's logit to -inf on that row
only, samples, and feeds the token back. Once the text is complete the mask lets only an end
token through, so the request ends there. An invalid schema or grammar is refused when the
request arrives (a 400 naming the field), never served unconstrained (llama.cpp #19051).
"""
from __future__ import annotations

import json

import llguidance
import llguidance.numpy as llnp
import numpy as np

from .sampling import BadParam


class Grammars:
    """The mask library bound to one tokenizer (built once per service: ~0.3 s)."""

    def __init__(self, tokenizer_json: str, vocab: int, stop_ids: list):
        self.vocab = vocab
        self.tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=list(stop_ids))

    def compile(self, field: str, kind: str, spec) -> str:
        """kind "json_schema" (spec: a schema dict) or "grammar" (spec: Lark or GBNF text) ->
        the library's grammar, checked here (BadParam naming `field` if it is not valid)."""
        try:
            if kind == "json_schema":
                if not isinstance(spec, dict):
                    raise ValueError("a JSON schema must be an object")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(spec), defaults={"whitespace_flexible": False})
            else:
                if not isinstance(spec, str) or not spec.strip():
                    raise ValueError("a grammar must be non-empty Lark or GBNF text")
                grammar = llguidance.grammar_from("grammar", spec)
        except ValueError as e:
            raise BadParam(field, f"is not valid: {str(e).splitlines()[0]}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise BadParam(field, f"is not valid: {error.splitlines()[0]}")
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(self, grammar)


class Constraint:
    """One request's place in its grammar: the next token's mask, the tokens taken so far."""

    def __init__(self, grammars: Grammars, grammar: str):
        self.matcher = llguidance.LLMatcher(grammars.tok, grammar, log_level=0)
        self.mask = llnp.allocate_token_bitmask(1, grammars.vocab)      # [1, ceil(V/32)]
        self.ready = False           # the mask is the next token's

    def fill(self):
        """Compute the next token's mask (the loop's mask thread, while a step runs)."""
        if not self.ready:
            llnp.fill_next_token_bitmask(self.matcher, self.mask)
            self.ready = True

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] (a view of the pool: not written) -> a copy with every token the grammar
        does not allow next at -inf."""
        self.fill()
        allowed = np.unpackbits(self.mask.view(np.uint8), bitorder="little")[:logits.shape[0]]
        return np.where(allowed.astype(bool), logits, np.float32(-np.inf))

    def take(self, token: int):
        """The token sampled under the mask (an end token once the text is complete)."""
        if not self.matcher.is_stopped():
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self.ready = False

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()
