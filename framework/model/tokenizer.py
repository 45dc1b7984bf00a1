"""A byte-level tokenizer: token i < 256 is the byte i; a few specials follow. Nothing to download."""
from __future__ import annotations


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258
    specials = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD}

    def __init__(self, vocab_size: int = 260):
        if vocab_size < 259:
            raise ValueError(f"vocab_size={vocab_size} is too small for 256 bytes + 3 specials")
        self.vocab_size = vocab_size
        self.eos_token_id = self.EOS

    def encode(self, text: str | bytes, add_bos: bool = False) -> list[int]:
        if isinstance(text, bytes):
            try:
                text.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"input is not valid UTF-8 (byte {e.start}: {text[e.start:e.start + 1]!r}); "
                                 "send text, or bytes that decode as UTF-8") from None
            data = text
        else:
            data = text.encode("utf-8", errors="strict")
        return ([self.BOS] if add_bos else []) + list(data)

    def decode(self, ids: list[int]) -> str:
        """Specials are dropped; a byte sequence that is not valid UTF-8 decodes with U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
