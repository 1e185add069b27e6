"""Token ids -> text with a model's tokenizer: shared by `rft topics` (tail, decoded exports) and the
experience operators (rft/experience/operators.py). Loads the tokenizer on first use; without a path it returns None."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenizerError(Exception):
    """The tokenizer could not be loaded (a user-facing error: the path is in the message)."""


class Detokenizer:
    """Token ids -> text with the model's tokenizer (loaded on first use); without a path, `text` is None."""

    def __init__(self, path: str, *, skip_special_tokens: bool = False):
        self.path, self.skip_special_tokens = path, skip_special_tokens
        self._tokenizer: PreTrainedTokenizerBase | None = None

    def text(self, tokens) -> str | None:
        if not self.path:
            return None
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # heavy, optional: only when text is asked for
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.path)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot load a tokenizer from {self.path}: {e}") from None
        text = self._tokenizer.decode([int(t) for t in tokens], skip_special_tokens=self.skip_special_tokens)
        assert isinstance(text, str)  # one sequence of ids decodes to one string (transformers types batches too)
        return text

