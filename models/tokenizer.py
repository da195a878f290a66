"""The tokenizer, rebuilt with `tokenizers` from the vocabulary inside the GGUF. Two kinds:

- byte-level BPE (`tokenizer.ggml.model = gpt2`: SmolLM2, Llama 3, Qwen): GGUF stores the tokens,
  merges and token types but not the pre-tokenizer, only its name (`tokenizer.ggml.pre`); each name
  is mapped here to the pre-tokenizer of the model's own tokenizer.json, so ids match Hugging
  Face's exactly.
- SentencePiece-style BPE (`llama`: Gemma, Llama 2): no merges in the file, only each token's
  score. llama.cpp merges, among adjacent pieces, the pair whose joined text is the token of the
  highest score, and spells what is left over as byte tokens (<0x41>); a BPE whose merges are every
  (a, b) with a, b and a+b in the vocabulary, ranked by the score of a+b, with byte fallback,
  computes the same. Spaces are "▁" in the vocabulary.
"""
from __future__ import annotations

from gguf import GGUFReader
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from .gguf_file import ModelError

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # gguf token types (llama.cpp's llama_token_type)
LONG_TEXT = 4096              # characters: above, encode in a way that lets other threads run
SPACE = "\u2581"              # "▁": a space in a SentencePiece vocabulary

# From the models' tokenizer.json: Llama-3 groups digits by up to three, Qwen2 splits them singly.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_tokenizer(pre: str):
    if pre == "smollm":  # SmolLM/SmolLM2: every digit its own token, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                 use_regex=True)])
    split = {"llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ModelError(f"unsupported tokenizer pre-tokenizer {pre!r} "
                         "(supported: smollm, llama-bpe, qwen2)")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                             use_regex=False)])


class Tokenizer:
    """Text <-> token ids for one GGUF model."""

    def __init__(self, reader: GGUFReader):
        meta = {k: f.contents() for k, f in reader.fields.items()
                if k.startswith("tokenizer.ggml.") and k not in ("tokenizer.ggml.scores",)}
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelError(f"unsupported tokenizer model {kind!r} (socllm reads byte-level BPE, "
                             "'gpt2', and SentencePiece-style BPE, 'llama')")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type", [])
        if kind == "llama":
            scores = reader.fields["tokenizer.ggml.scores"].contents()
            self._tok = _sentencepiece(tokens, scores, types,
                                       meta.get("tokenizer.ggml.add_space_prefix", True),
                                       int(meta.get("tokenizer.ggml.unknown_token_id", 0)))
        else:
            merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
            pre = meta.get("tokenizer.ggml.pre", "default")
            bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                             ignore_merges=(pre == "llama-bpe"))  # Llama-3's tokenizer.json sets it
            self._tok = HFTokenizer(bpe)
            self._tok.pre_tokenizer = _pre_tokenizer(pre)
            self._tok.decoder = decoders.ByteLevel()
        # Control tokens ('<|im_start|>') are matched whole before BPE, so they encode to one id.
        self._tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                      for i, t in enumerate(types) if t == CONTROL])
        self._tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                              for i, t in enumerate(types) if t == USER_DEFINED])
        self.vocab_size = len(tokens)
        self.eos_id: int = int(meta["tokenizer.ggml.eos_token_id"])
        self.bos_id: int = int(meta.get("tokenizer.ggml.bos_token_id", self.eos_id))
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        self._tokens = tokens
        # no token spells more characters than this: a text of L characters is at least
        # L / max_token_chars tokens (a prompt far too long is refused without tokenizing it)
        self.max_token_chars = max(map(len, tokens))

    def encode(self, text: str, bos: bool = False) -> list[int]:
        """Token ids of `text`; bos=True prepends BOS (pass `self.add_bos` for a raw prompt)."""
        if len(text) > LONG_TEXT:     # encode_batch lets go of the GIL (encode holds it): a long
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids   # text does not
        else:                                                                       # stall threads
            ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if bos else ids

    def to_json(self) -> str:
        """The `tokenizers` JSON of this tokenizer (what a mask library builds its own from)."""
        return self._tok.to_str()

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def stop_ids(self) -> list[int]:
        """EOS and the end-of-turn tokens llama.cpp recognizes by their text (llama-vocab.cpp's
        end-of-generation set): generation stops at any of them, and no text shows them."""
        ids = {self.eos_id}
        for text in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|end|>",
                     "<|eom_id|>", "<|end_of_text|>"):
            enc = self.encode(text)
            if len(enc) == 1:
                ids.add(enc[0])
        return sorted(ids)

    def token_text(self, i: int) -> str:
        """The vocabulary entry of id `i`, as stored (byte-level 'Ġ' or SentencePiece '▁' for a
        space)."""
        return self._tokens[i]

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


def _sentencepiece(tokens: list, scores: list, types: list, space_prefix: bool, unk: int) -> HFTokenizer:
    """llama.cpp's SPM tokenizer as a `tokenizers` BPE (module docstring): merges from the
    vocabulary, ranked by the joined token's score (ties: the earlier token), byte fallback."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for i, t in enumerate(tokens):
        if types and types[i] != NORMAL:
            continue
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in vocab and b in vocab:
                merges.append((-scores[i], i, vocab[a], vocab[b], a, b))
    merges.sort()
    bpe = models.BPE(vocab, [(a, b) for *_, a, b in merges], byte_fallback=True,
                     unk_token=tokens[unk], fuse_unk=True)
    tok = HFTokenizer(bpe)
    steps = [normalizers.Prepend(SPACE)] if space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()] + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return tok


class StreamDecoder:
    """Detokenize one generated id at a time, emitting text only once its UTF-8 is complete.

    A character can span several byte-level tokens (an emoji is often 2-4); decoding a prefix of
    it yields U+FFFD, so new text is held back until it no longer ends in one. Only a short window
    of ids is re-decoded each step: ids before `prefix` are settled and never looked at again.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: decoding from here gives stable text
        self.read = 0    # ids[:read] have been emitted

    def feed(self, token_id: int) -> str:
        """Add one id; return the text it completes ('' while a character is still partial)."""
        self.ids.append(int(token_id))
        done = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a truncated character comes out as U+FFFD)."""
        done = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]
