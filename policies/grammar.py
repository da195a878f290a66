"""Constrained decoding: structured output and well-formed tool calls (DESIGN.md §5).

A request may carry a constraint: a JSON schema (`response_format` json_object / json_schema, or
the tools' call schema, models/tools.py) or a grammar (Lark or GBNF). llguidance (the mask library
llama.cpp, vLLM and SGLang also use) compiles it against the model's tokenizer and, at each step,
gives the set of tokens that keep the text inside the language as a bitmask [ceil(V/32)] int32.
The serving loop fills the masks of the next step's constrained rows on a CPU thread while the
processors run the step (actors/engine.py), then sets every other token's logit to -inf on that row
only, samples, and feeds the token back. Once the text is complete the mask lets only an end
token through, so the request ends there. An invalid schema or grammar is refused when the
request arrives (a 400 naming the field), never served unconstrained (llama.cpp #19051).
"""
from __future__ import annotations

import json

import llguidance
import llguidance.numpy as llnp
import numpy as np

from .drafting import MAX_DRAFT
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
        # [1 + MAX_DRAFT, ceil(V/32)]: row j, the mask after the step's first j drafted tokens
        self.masks = llnp.allocate_token_bitmask(1 + MAX_DRAFT, grammars.vocab)
        self.draft: list = []        # this step's drafted tokens not yet taken (policies/drafting.py)
        self.row = 0                 # the mask row of the next token
        self.ready = False           # the masks are this step's

    def forced(self) -> list:
        """The tokens the grammar forces next (a schema's keys and punctuation): drafts that
        cost a verified row and nothing else."""
        if self.matcher.is_stopped():
            return []
        return list(self.matcher.compute_ff_tokens())[:MAX_DRAFT]

    def set_draft(self, draft: list) -> list:
        """This step's drafted tokens, cut where the grammar would refuse one."""
        n = 0 if self.matcher.is_stopped() or not draft else self.matcher.validate_tokens(draft)
        self.draft, self.ready, self.row = list(draft[:n]), False, 0
        return self.draft

    def fill(self):
        """Compute this step's masks (the loop's mask thread, while a step runs): the next
        token's, and after each drafted token the one after it (consumed, then rolled back)."""
        if self.ready:
            return
        m = self.matcher
        llnp.fill_next_token_bitmask(m, self.masks, 0)
        consumed = 0
        for j, tok in enumerate(self.draft, 1):
            # once the text is complete (stopped) an end token is taken but not kept: rolling
            # it back too took back the token before the draft (a 500 where an agent's history
            # held the reply's own JSON: the lookup drafted it to its end, EOS and all)
            consumed += not m.is_stopped()
            if not m.consume_token(tok):
                raise RuntimeError(f"the grammar refused drafted token {tok}: {m.get_error()}")
            llnp.fill_next_token_bitmask(m, self.masks, j)
        if consumed:
            m.rollback(consumed)
        self.ready, self.row = True, 0

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """logits [V] of the next token (a view of the pool: not written) -> a copy with every
        token the grammar does not allow there at -inf (the mask after the drafted tokens taken
        so far this step)."""
        self.fill()
        allowed = np.unpackbits(self.masks[self.row].view(np.uint8), bitorder="little")[:logits.shape[0]]
        return np.where(allowed.astype(bool), logits, np.float32(-np.inf))

    def take(self, token: int):
        """The token sampled under the mask (an end token once the text is complete). The rows
        after it keep their masks while it is the drafted token there (verification)."""
        if not self.matcher.is_stopped():
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        if self.draft and token == self.draft[0]:
            self.draft, self.row = self.draft[1:], self.row + 1
        else:
            self.draft, self.ready = [], False

    @property
    def complete(self) -> bool:
        return self.matcher.is_stopped() or self.matcher.is_accepting()
