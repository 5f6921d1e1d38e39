"""Tokenizers: text <-> the token ids of the model a node serves.

Two kinds behind one interface (`Tokenizer`):

- `HFTokenizer`, for a Hugging Face checkpoint directory: `tokenizer.json` through the
  `tokenizers` library (the fast tokenizer itself, so ids match the model's vocabulary exactly;
  no transformers or torch), `tokenizer_config.json` for the special tokens, `add_bos_token` and
  the chat template, and `generation_config.json` for the EOS ids the model was trained to stop
  at (one id or a list: instruct models often end a turn with a token other than the base EOS).
- `ByteTokenizer`, only for the built-in reference model (random weights, no vocabulary file):
  token ids are the UTF-8 bytes of the text, so `--text` has something exact to send. It means
  nothing to a real checkpoint, whose ids are BPE pieces.

The `tokenizers` library is called through its batch functions (one item), which release the
GIL while they run: a long text is encoded in a server's worker thread without stopping its
event loop (the single-item functions hold the GIL throughout).

Decoding never raises: an id the vocabulary does not have (a model's embedding table is often
larger than its tokenizer, and a random model samples anything) comes out as U+FFFD.
Streaming text is runtime/client/detokenizer.py's job. tokenizer_config.json's
`clean_up_tokenization_spaces` is not applied: it rewrites text across token boundaries (" ." ->
"."), which a stream has already printed.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

REPLACEMENT = "\ufffd"
BYTE_VOCAB_SIZE = 256
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class TokenizerError(ValueError):
    """A tokenizer directory is missing a file or holds one that cannot be used; the message
    names the file and what is wrong with it."""


class Tokenizer(Protocol):
    """What a client needs from a tokenizer: ids for a prompt, text for ids, when to stop, and
    what a chat template needs to render."""

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class ByteTokenizer:
    """The reference model's identity tokenizer: ids are UTF-8 bytes, ids >= 256 decode as
    U+FFFD. Not a vocabulary: no special tokens, no EOS, no chat template."""

    name: str = "bytes (reference model)"
    vocab_size: int = BYTE_VOCAB_SIZE
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(text.encode("utf-8"))
        except UnicodeEncodeError as e:  # a lone surrogate, which JSON can carry
            raise TokenizerError(f"the text is not valid Unicode: {e.reason} at character {e.start}") from None

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Invalid UTF-8 and ids outside 0..255 become U+FFFD (each bad id one, and it ends a
        pending character, as it would in a byte stream)."""
        return _split_decode(token_ids, BYTE_VOCAB_SIZE, lambda run: bytes(run).decode("utf-8", "replace"))


@dataclass
class HFTokenizer:
    """A Hugging Face checkpoint's tokenizer (see the module docstring). Build it with
    `HFTokenizer.from_dir(DIR)`."""

    name: str
    backend: Any                        # tokenizers.Tokenizer
    vocab_size: int                     # ids the tokenizer knows, added tokens included
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    special_tokens: dict[str, str]      # bos_token, eos_token, ... -> their text (for templates)
    bos_token_id: int | None = None
    add_bos_token: bool | None = None   # None: the tokenizer.json post-processor decides

    @classmethod
    def from_dir(cls, directory: str) -> "HFTokenizer":
        """Load DIR/tokenizer.json (required), DIR/tokenizer_config.json and
        DIR/generation_config.json (optional); TokenizerError names what is wrong."""
        from tokenizers import Tokenizer as Backend

        if not os.path.isdir(directory):
            raise TokenizerError(f"tokenizer directory {directory!r} does not exist")
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"{directory} has no tokenizer.json (kvrt reads the fast tokenizer's "
                                 f"tokenizer.json; a checkpoint with only a SentencePiece tokenizer.model is "
                                 f"not supported)")
        try:
            backend = Backend.from_file(path)
        except Exception as e:  # the library raises plain Exceptions for malformed files
            raise TokenizerError(f"{path}: not a usable tokenizer.json: {e}") from None
        cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
        gen = _read_json(os.path.join(directory, "generation_config.json"))
        vocab_size = backend.get_vocab_size(with_added_tokens=True)
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(cfg.get(name), f"tokenizer_config.json {name}")
            if text is not None:
                special[name] = text
        ids = {name: backend.token_to_id(text) for name, text in special.items()}
        add_bos = cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TokenizerError(f"{directory}/tokenizer_config.json: add_bos_token must be true or false, "
                                 f"got {add_bos!r}")
        if "eos_token_id" in gen:
            eos = _eos_ids(gen["eos_token_id"], vocab_size, f"{directory}/generation_config.json")
        else:
            eos = (ids["eos_token"],) if ids.get("eos_token") is not None else ()
        return cls(name=os.path.abspath(directory), backend=backend, vocab_size=vocab_size, eos_token_ids=eos,
                   chat_template=_chat_template(directory, cfg), special_tokens=special,
                   bos_token_id=ids.get("bos_token"), add_bos_token=add_bos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As Hugging Face's fast tokenizer encodes: the post-processor adds the special tokens
        it was saved with, and an explicit `add_bos_token` in tokenizer_config.json overrides
        whether a BOS leads (Llama-family tokenizers rebuild their post-processor from it)."""
        ids = self._encode(text, add_special_tokens)
        bos = self.bos_token_id
        if not add_special_tokens or self.add_bos_token is None or bos is None:
            return ids
        added = ids[:1] == [bos] and self._encode(text, False)[:1] != [bos]
        if self.add_bos_token and not added:
            return [bos] + ids
        if not self.add_bos_token and added:
            return ids[1:]
        return ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return _split_decode(token_ids, self.vocab_size,
                             lambda run: self.backend.decode_batch([run], skip_special_tokens=skip_special_tokens)[0])

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as e:  # the library raises plain Exceptions (text it cannot take: a lone surrogate)
            raise TokenizerError(f"the tokenizer cannot encode this text: {str(e)[:200]}") from None


def _split_decode(token_ids: Iterable[int], vocab_size: int, decode_run) -> str:
    """Decode runs of known ids with `decode_run`; each unknown id is one U+FFFD between them."""
    out: list[str] = []
    run: list[int] = []
    for t in token_ids:
        t = int(t)
        if 0 <= t < vocab_size:
            run.append(t)
            continue
        if run:
            out.append(decode_run(run))
            run = []
        out.append(REPLACEMENT)
    if run:
        out.append(decode_run(run))
    return "".join(out)


def _read_json(path: str) -> dict:
    """An optional JSON object file: {} when absent, TokenizerError when unreadable."""
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: object, what: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken object
    ({"content": ...}) or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{what}: expected a string, null or an object with a string 'content', got {value!r}")


def _eos_ids(value: object, vocab_size: int, where: str) -> tuple[int, ...]:
    """generation_config.json's eos_token_id: an id, a list of ids, or null."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < vocab_size:
            raise TokenizerError(f"{where}: eos_token_id must be an id in 0..{vocab_size - 1} or a list of them, "
                                 f"got {value!r}")
    return tuple(dict.fromkeys(items))


def _chat_template(directory: str, cfg: dict) -> str | None:
    """The chat template: chat_template.jinja when the checkpoint ships one (newer saves do),
    else tokenizer_config.json's chat_template (a string, or named templates: "default")."""
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{path}: cannot read it: {e}") from None
    tpl = cfg.get("chat_template")
    if tpl is None or isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TokenizerError(f"{directory}/tokenizer_config.json: chat_template must be a string or a list of "
                         f"named templates with a 'default' one")

