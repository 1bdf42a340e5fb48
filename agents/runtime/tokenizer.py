"""Text <-> token ids for a served model.

Two codecs behind one interface:

- `ByteCodec`, for shardwise's seeded presets: ids 0..255 are bytes, 256 BOS, 257 EOS, 258 PAD (no file).
- `HuggingFaceCodec`, for a checkpoint: the `tokenizers` library on its `tokenizer.json` (pre-tokenizer,
  model, post-processor and decoder as the checkpoint defines them, so `encode` adds the BOS a model expects
  exactly as transformers' `tokenizer(text)` does), and its chat template (`chat_template.jinja`, or
  `chat_template` in `tokenizer_config.json`) rendered with jinja2 in a sandbox, with the same environment
  transformers gives templates (trim_blocks, lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
  a `tojson` that keeps non-ASCII characters). A rendered chat is tokenized without adding special tokens: the
  template wrote them.

`eos_ids` are the tokens that end a request with finish_reason "stop": the checkpoint's
`generation_config.json` `eos_token_id` (one id or a list), else its config's, else the tokenizer's EOS token.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from shardwise import checkpoint

BOS = 256
EOS = 257
PAD = 258
NUM_SPECIAL = 4  # 256..259; tiny presets have vocab 260


def encode(text: str, *, bos: bool = True) -> list[int]:
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode(ids: list[int]) -> str:
    """Bytes back to text; specials are dropped and broken UTF-8 sequences replaced."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class ChatUnsupported(ValueError):
    """The model has no chat template."""


class Codec(Protocol):
    eos_ids: tuple[int, ...]

    def encode(self, text: str, *, special: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]: ...


class ByteCodec:
    eos_ids: tuple[int, ...] = (EOS,)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return encode(text, bos=special)

    def decode(self, ids: list[int]) -> str:
        return decode(ids)

    def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        raise ChatUnsupported("the seeded presets have no chat template; use /v1/completions")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class HuggingFaceCodec:
    def __init__(self, directory: Path, eos_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer

        path = directory / checkpoint.TOKENIZER
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception subclass for every malformed file
            raise checkpoint.CheckpointError(str(path), f"not a tokenizer.json tokenizers can read: {e}") from e
        config: dict[str, Any] = {}
        if (directory / checkpoint.TOKENIZER_CONFIG).exists():
            loaded = json.loads((directory / checkpoint.TOKENIZER_CONFIG).read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        self.special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                        if (t := _token_text(config.get(k))) is not None}
        template = config.get("chat_template")
        if (directory / checkpoint.CHAT_TEMPLATE).exists():
            template = (directory / checkpoint.CHAT_TEMPLATE).read_text(encoding="utf-8")
        self.template = template if isinstance(template, str) else None
        eos_token = self.special.get("eos_token")
        eos_from_tokenizer = self.tokenizer.token_to_id(eos_token) if eos_token else None
        self.eos_ids = eos_ids or ((eos_from_tokenizer,) if eos_from_tokenizer is not None else ())
        self._compiled: Any = None

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            raise ChatUnsupported("the checkpoint has no chat template (chat_template.jinja or "
                                  "tokenizer_config.json's chat_template); use /v1/completions")
        if self._compiled is None:
            self._compiled = _environment().from_string(self.template)
        return str(self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self.special))

    def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=add_generation_prompt), special=False)


def _environment() -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def open_codec(weights_dir: str | None) -> Codec:
    """The codec of a model: the checkpoint's tokenizer.json, or bytes for seeded weights and presets."""
    if not weights_dir or not checkpoint.is_checkpoint(Path(weights_dir)):
        return ByteCodec()
    directory = Path(weights_dir)
    info = checkpoint.inspect(directory)
    if not info.has_tokenizer:
        return TokenIdsOnly(info.eos_token_ids)
    return HuggingFaceCodec(directory, info.eos_token_ids)


class TokenIdsOnly:
    """A checkpoint without tokenizer.json: prompts must be token ids, and responses carry no text."""

    def __init__(self, eos_ids: tuple[int, ...]) -> None:
        self.eos_ids = eos_ids

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        raise ChatUnsupported("the checkpoint has no tokenizer.json: send the prompt as token ids")

    def decode(self, ids: list[int]) -> str:
        return ""

    def chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> list[int]:
        raise ChatUnsupported("the checkpoint has no tokenizer.json: chat needs one")
