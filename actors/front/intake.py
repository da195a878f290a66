"""The service's edge: what a request asks, checked once, before anything queues (its
parameters, its prompt as ids within the context, the rule its reply must follow), and what a poll
answers, in the API's shapes (pieces, state, OpenAI's and vLLM's logprobs, the tool calls of a
reply). No Ray: the service (actors/service.py) holds one Intake over its pool."""
from __future__ import annotations

import dataclasses
import threading
import time

from socllm.policies.request import Sequence, check_priority
from socllm.policies.drafting import MODES as SPECULATE, Prediction
from socllm.policies.sampling import BadParam, SamplingParams

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
EMBED = ("mean", "last")        # an embedding's pooling of the prompt rows' final hidden states


class Intake:
    def __init__(self, pool, speculate: str, heads: bool):
        """pool: the service's (tokenizer, template, context, vocabulary, stop ids); speculate:
        the service's mode (config.speculate); heads: whether it has draft heads."""
        self.pool, self.speculate, self.heads = pool, speculate, heads
        self._grammars, self.grammar_lock = None, threading.Lock()   # policies/grammar.py, lazily

    def check_params(self, priority, speculate, sampling: dict, prediction=None):
        """Raise BadParam (ValueError) for a parameter this service does not take or a value it
        refuses, before anything is tokenized. prediction (OpenAI's Predicted Outputs, its text):
        drafts for speculative decoding, so a request that drafts none cannot take it."""
        for name in set(sampling) - set(SAMPLING_FIELDS):
            raise BadParam(name, f"is not supported by this service (it takes "
                                 f"{', '.join(SAMPLING_FIELDS)}, priority, stop, ignore_eos, "
                                 f"response_format, grammar, tools, tool_choice, parallel_tool_calls, "
                                 f"speculate)")
        check_priority(priority)
        if speculate is not None:
            if speculate not in SPECULATE:
                raise BadParam("speculate", f"must be one of {', '.join(SPECULATE)}, got {speculate!r}")
            if self.speculate == "off" and speculate != "off":
                raise BadParam("speculate", "is off on this service (socllm serve --speculate off)")
            if speculate == "heads" and not self.heads:
                raise BadParam("speculate", "heads: this service has no draft heads for its model")
        if prediction is not None:
            if not isinstance(prediction, str):
                raise BadParam("prediction", "must be the predicted text")
            if len(prediction) > self.pool.context * self.pool.tokenizer.max_token_chars:
                raise BadParam("prediction", "is longer than any reply the context could hold")
            if (speculate or self.speculate) in ("off", "heads"):      # the request's, else the service's
                raise BadParam("prediction", "drafts for speculative decoding, which this request does "
                               "not do (speculate off or heads, or socllm serve --speculate off)")
        SamplingParams(**{"max_tokens": self.pool.context,                   # a bad value
                          **{k: v for k, v in sampling.items() if v is not None}})

    def check_embed(self, embed, messages, sampling: dict, hidden: bool, shape: tuple) -> dict:
        """An embedding request (embed not None): a pooling this service has, a prompt (text or
        ids: no chat messages, and none of shape's response_format, grammar, tools, prediction),
        no reply's sampling; hidden: whether this plan's decode steps write the rows' hidden
        states (runner.hidden_rows). -> the sampling fields to take (one token's: it never
        decodes)."""
        if embed is None:
            return sampling
        if embed not in EMBED:
            raise BadParam("pooling", f"must be one of {', '.join(EMBED)}, got {embed!r}")
        if messages is not None or any(x is not None for x in shape):
            raise BadParam("embed", "takes a prompt (text or token ids): no chat messages, "
                                    "response_format, grammar, tools or prediction")
        for name, v in sampling.items():
            if v is not None and name != "max_tokens":
                raise BadParam(name, "is not taken by an embedding request")
        if not hidden:
            raise ValueError("embeddings need a plan whose decode steps run on the GPU or the CPU "
                             "(this service's write no hidden states)")
        return {"max_tokens": 1}

    def grammars(self):
        """The mask library on this model's tokenizer, built at the first constrained request."""
        with self.grammar_lock:
            g = self._grammars          # drop_grammars may clear it at any time: this one is kept
            if g is None:
                from socllm.policies.grammar import Grammars
                e = self.pool
                g = self._grammars = Grammars(e.tokenizer.to_json(), e.cfg.vocab, e.stop_ids)
        return g

    @property
    def grammars_loaded(self) -> bool:
        return self._grammars is not None

    def drop_grammars(self):
        """The mask library goes (~34 MB: the service has been idle, Engine.on_release); the next
        constrained request builds it again. One assignment, no lock: a build in progress (it
        holds the lock ~0.3 s) stores its library after, and a running constraint keeps its own."""
        self._grammars = None

    def prompt_ids(self, prompt, messages, ids, shape: dict) -> tuple:
        """(prompt ids, the reply's Constraint or None, whether the reply holds tool calls): in
        the request's thread, the mask library built there where it is not (and not on the
        service's event loop)."""
        ids, rule, tooled = self._prompt_rule(prompt, messages, ids, shape)
        return ids, rule and self.grammars().constraint(rule), tooled

    def _prompt_rule(self, prompt, messages, ids, shape: dict) -> tuple:
        """(prompt ids, the reply's grammar or None, whether the reply holds tool calls)."""
        e = self.pool
        if sum(x is not None for x in (prompt, messages, ids)) != 1:
            raise ValueError("give exactly one of prompt, messages or ids")
        rule, tools, choice = self._reply_rule(shape, chat=messages is not None)
        if shape.get("prediction"):                  # its ids, for the drafter (policies/drafting.py)
            shape["prediction_ids"] = Prediction(e.tokenizer.encode(shape["prediction"], bos=False))
        if ids is not None:
            if not ids or not all(isinstance(t, int) and 0 <= t < e.cfg.vocab for t in ids):
                raise ValueError(f"ids must be a non-empty list of token ids below {e.cfg.vocab}")
            return self._within(list(ids)), rule, False
        if messages is not None:
            text = _rendered(e.template, messages, tools, choice, shape.get("continue"))
            self._fits(text)
            return self._within(e.tokenizer.encode(text, bos=e.tokenizer.add_bos)), rule, choice != "none"
        if shape.get("continue"):
            raise BadParam("continue_final_message", "is for chat messages only")
        if not isinstance(prompt, str):
            raise ValueError("the prompt must be a string")
        self._fits(prompt)
        return e.encode_prompt(prompt), rule, False

    def _reply_rule(self, shape: dict, chat: bool) -> tuple:
        """What constrains the reply (policies/grammar.py): (the compiled rule or None, the
        tools, the tool choice: "none" without tools)."""
        from socllm.models.tools import call_schema
        schema = self._response_schema(shape["response_format"])
        tools, choice = _tools(shape["tools"], shape["tool_choice"], chat)
        if shape["grammar"] is not None and (schema is not None or choice != "none"):
            raise BadParam("grammar", "cannot be combined with response_format or tools")
        if shape.get("continue") and (schema is not None or choice != "none" or shape["grammar"]):
            raise BadParam("continue_final_message", "cannot be combined with response_format, "
                           "grammar or tools (their rule holds for a whole reply)")
        if choice != "none":
            return self.grammars().compile("tools", "json_schema",
                                            call_schema(tools, choice, shape["parallel"], schema)), tools, choice
        if schema is not None:
            return self.grammars().compile("response_format", "json_schema", schema), tools, choice
        if shape["grammar"] is not None:
            return self.grammars().compile("grammar", "grammar", shape["grammar"]), tools, choice
        return None, tools, choice

    @staticmethod
    def _response_schema(fmt) -> dict | None:
        """OpenAI's response_format -> the JSON schema the reply must match (None: free text)."""
        if fmt is None or fmt == {"type": "text"}:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if isinstance(spec, dict) and isinstance(spec.get("schema"), dict):
                from socllm.models.tools import closed
                return closed(spec["schema"]) if spec.get("strict") else spec["schema"]
            raise BadParam("response_format", "json_schema needs {json_schema: {name, schema}}")
        raise BadParam("response_format", "must be {type: text}, {type: json_object} or "
                       "{type: json_schema, json_schema: {...}}")

    def _within(self, ids: list) -> list:
        if len(ids) >= self.pool.context:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.pool.context}")
        return ids

    def _fits(self, text: str):
        """Refuse at once a text that cannot fit the context, however it tokenizes (no token is
        longer than max_token_chars characters): nothing that large is tokenized."""
        e = self.pool
        if len(text) > e.context * e.tokenizer.max_token_chars:
            raise ValueError(f"the prompt has {len(text)} characters, more than the context "
                             f"({e.context} tokens) can hold")

    def answer(self, seq: Sequence, seen: int, seen_logprobs: int) -> dict:
        """A poll's answer: the pieces after `seen`, the state, and where asked the logprobs
        after `seen_logprobs`; an ended reply with tools, its content and tool calls."""
        pieces = seq.pieces[seen:]
        out = {"pieces": pieces, "seen": seen + len(pieces), "state": seq.state,
               "finish_reason": seq.finish_reason, "error": seq.error, "usage": seq.usage()}
        if seq.params.logprobs is not None:       # the tokens' since the last poll
            out["logprobs"] = self._logprobs(seq, seen_logprobs)
            out["seen_logprobs"] = seen_logprobs + len(out["logprobs"])
        if seq.ended:
            out["timings"] = timings(seq)
            if seq.stops is not None and seq.stops.hit:
                out["stop_string"] = seq.stops.hit        # the stop string that ended it
            if seq.params.prompt_logprobs is not None:    # once, with the end
                out["prompt_logprobs"] = self._logprobs(seq, 0, prompt=True)
        if seq.embed is not None and seq.ended:
            out["embedding"] = seq.embedding
        if seq.tools and seq.ended:           # the reply, read as models/tools.py's format
            from socllm.models.tools import parse_reply
            content, calls = parse_reply(seq.text)
            out["message"] = {"content": content, "tool_calls": calls}
            if calls and seq.finish_reason == "stop":
                out["finish_reason"] = "tool_calls"
        return out

    def _logprobs(self, seq: Sequence, start: int, prompt: bool = False) -> list:
        """[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}] (OpenAI's chat
        shape) of the tokens chosen from `start` on, a stop token left out as the text leaves it;
        prompt: of the prompt's tokens instead (prompt_logprobs), the first with logprob and
        top_logprobs None (nothing comes before it), each with its id and rank (vLLM's shape)."""
        tk, stops = self.pool.tokenizer, () if seq.ignore_eos else self.pool.stop_ids

        def entry(t: int, lp: float) -> dict:
            text = tk.decode([t])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        if prompt:
            return [entry(seq.prompt[0], None) | {"id": seq.prompt[0], "rank": None, "top_logprobs": None}] + [
                entry(t, lp) | {"id": t, "rank": rank,
                                "top_logprobs": [entry(a, alp) | {"id": a} for a, alp in top]}
                for t, lp, top, rank in seq.sampler.prompt_logprobs]
        return [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top]}
                for t, lp, top in seq.sampler.logprobs[start:] if t not in stops]

    def tokens(self, prompt, messages, add_special: bool, tools=None, tool_choice=None,
               continue_final: bool = False) -> tuple:
        """(the text a request with this prompt or these chat messages (and tools; its final
        message continued) starts from, whether the model's BOS is added): /tokenize's and
        count_tokens'."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError("the prompt must be a string")
        listed, choice = _tools(tools, tool_choice, chat=messages is not None)
        text = prompt if messages is None else _rendered(self.pool.template, messages, listed, choice,
                                                         continue_final)
        return text, bool(add_special) and self.pool.tokenizer.add_bos

    def detokenize(self, ids: list) -> str:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                and 0 <= t < self.pool.cfg.vocab for t in ids):
            raise ValueError(f"tokens must be a list of token ids below {self.pool.cfg.vocab}")
        return self.pool.tokenizer.decode(ids)


def _rendered(template, messages: list, tools, choice: str, continue_final: bool) -> str:
    """Chat messages (and tools) as the model's template renders them, for its reply; with
    continue_final (vLLM's continue_final_message), the reply continues the final message,
    which must be the assistant's text."""
    from socllm.models.chat import render_chat
    from socllm.models.tools import chat_messages
    said = chat_messages(messages, tools, choice)
    if not continue_final:
        return render_chat(template, said)
    last = messages[-1]
    if last.get("role") != "assistant" or last.get("tool_calls") or not said[-1]["content"].strip():
        raise BadParam("continue_final_message", "needs a final assistant message with text to "
                       "continue (and no tool calls)")
    from socllm.models.gguf_file import ModelError
    try:
        return render_chat(template, said, continue_final=True)
    except ModelError:
        raise
    except ValueError as e:               # the template left the final text out
        raise BadParam("continue_final_message", f"cannot be done: {e}") from None


def _tools(tools, tool_choice, chat: bool) -> tuple:
    """A request's (checked tools or None, tool choice): "none" without tools."""
    from socllm.models.tools import check_tool_choice, check_tools
    if tools is None and tool_choice in (None, "none", "auto"):
        return None, "none"
    if not chat:
        raise BadParam("tools", "are for chat messages only")
    listed = check_tools(tools)
    return listed, check_tool_choice(tool_choice, listed)


def timings(seq: Sequence) -> dict:
    """How a request ran so far: time to its first token, and its prefill and decode rates."""
    first = seq.first_token or seq.arrival
    ttft, n_dec = first - seq.arrival, max(0, len(seq.tokens) - 1)
    dt = (seq.finish or time.monotonic()) - first
    return {"ttft_s": ttft, "prefill_s": first - (seq.prefill_start or first), "decode_s": dt,
            "decode_tok_s": n_dec / dt if n_dec and dt > 0 else 0.0,
            "prefill_tok_s": len(seq.prompt) / ttft if ttft > 0 else 0.0}
