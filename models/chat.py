"""Chat prompts: the model's own jinja2 chat template (`tokenizer.chat_template`), rendered.

The template is code shipped inside the model file, so it runs in jinja2's sandbox. The
environment matches Hugging Face's apply_chat_template (trim_blocks, lstrip_blocks,
raise_exception, bos/eos token strings) so prompts match the ones the model was tuned on.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gguf import GGUFReader
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .gguf_file import ModelError

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template and the special tokens it may write, kept without the GGUF reader."""
    source: str | None
    special: dict

    @classmethod
    def from_reader(cls, reader: GGUFReader) -> "ChatTemplate":
        return cls(_source(reader), _special_tokens(reader))


def render_chat(reader_or_template: GGUFReader | ChatTemplate | str, messages: list[Message],
                add_generation_prompt: bool = True, continue_final: bool = False, **extra) -> str:
    """Render `messages` to prompt text, ending with the assistant's header if asked;
    continue_final: ending instead inside the final message, right after its text (continued)."""
    if isinstance(reader_or_template, ChatTemplate):
        if reader_or_template.source is None:
            raise ModelError("the model file has no chat template (tokenizer.chat_template)")
        template, special = reader_or_template.source, reader_or_template.special
    elif isinstance(reader_or_template, str):
        template, special = reader_or_template, {}
    else:
        template, special = _template_of(reader_or_template), _special_tokens(reader_or_template)
    def render(msgs: list) -> str:
        try:
            return _compile(template).render(messages=msgs, add_generation_prompt=add_generation_prompt
                                             and not continue_final, **special, **extra)
        except TemplateError as e:
            raise ModelError(f"chat template failed: {str(e).splitlines()[0]}") from None
    text = render(messages)
    if not continue_final:
        return text
    marked = render(messages[:-1] + [{**messages[-1], "content": MARK}])
    return continued(text, marked, messages[-1]["content"])


MARK = "SOCLLMFINALMESSAGE0x5f3759df"    # stands for the final message's text, to find where it goes


def continued(text: str, marked: str, final: str) -> str:
    """A rendered chat cut right after its final message's text, the end of that turn left out,
    so that the reply continues it (Hugging Face's apply_chat_template(continue_final_message),
    and vLLM's): marked, the same chat rendered with MARK for that text, says where the text
    starts (never inside the template's own markers, as a search for a short text could be),
    and the text's trailing spaces are kept where the template keeps them."""
    at = marked.find(MARK)
    if marked.count(MARK) != 1 or not final.strip() or marked[:at] != text[:at]:
        raise ValueError("the final message has no text the chat template kept, to continue")
    for kept in (final, final.rstrip(), final.lstrip(), final.strip()):
        if text.startswith(kept, at):
            return text[:at + len(kept)]
    raise ValueError("the chat template changes the final message's text: it cannot be continued")


def chat_prompt(template: GGUFReader | ChatTemplate | str, user_text: str, system: str | None = None) -> str:
    """One user turn (after an optional system prompt), ready for the assistant's reply."""
    messages = [{"role": "system", "content": system}] if system else []
    return render_chat(template, messages + [{"role": "user", "content": user_text}])


def _template_of(reader: GGUFReader) -> str:
    source = _source(reader)
    if source is None:
        raise ModelError("the model file has no chat template (tokenizer.chat_template)")
    return source


# A file without a template gets its family's, as llama.cpp's built-in one renders it
# (llama-chat.cpp): Gemma has no system turn, so a system message opens the first user turn.
BUILTIN = {"gemma3": """
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
  {%- if m['role'] == 'system' -%}
    {%- set ns.system = ns.system + (m['content'] | trim) -%}
  {%- else -%}
    {%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
    {{- '<start_of_turn>' + role + '\n' -}}
    {%- if ns.system and role != 'model' -%}
      {{- ns.system + '\n\n' -}}
      {%- set ns.system = '' -%}
    {%- endif -%}
    {{- (m['content'] | trim) + '<end_of_turn>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""}


def _source(reader: GGUFReader) -> str | None:
    """The file's chat template, or its family's built-in one, or None."""
    field = reader.fields.get("tokenizer.chat_template")
    if field is not None:
        return field.contents()
    arch = reader.fields.get("general.architecture")
    return BUILTIN.get(arch.contents() if arch is not None else None)


def _special_tokens(reader: GGUFReader) -> dict[str, str]:
    """bos_token / eos_token as text, which templates such as Llama-3's write out."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    out = {}
    for name in ("bos", "eos"):
        field = reader.fields.get(f"tokenizer.ggml.{name}_token_id")
        if tokens is not None and field is not None:
            # The tokens array's parts are [.., len, bytes, len, bytes, ..]: index via data.
            out[f"{name}_token"] = bytes(tokens.parts[tokens.data[field.contents()]]).decode()
    return out


def _raise(message: str):
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)
