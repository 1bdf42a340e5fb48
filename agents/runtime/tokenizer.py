"""A byte-level tokenizer: token ids 0..255 are bytes; 256.. are specials. No vocabulary file needed."""

from __future__ import annotations

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
