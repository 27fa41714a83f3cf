"""A generation's tokens and text, grown one token at a time through the EOS, stop-string and length rules."""
from __future__ import annotations


class Completion:
    """The tokens and text so far, grown one token at a time through the EOS, stop-string and length checks.

    A verify round commits several tokens at once; feeding them one by one makes the result (tokens,
    text, finish reason) exactly what `ar` gives, wherever the round boundaries fall. The rules are
    vLLM v1's (v1/engine/detokenizer.py:96-160 in vLLM 0.32): EOS and stop_token_ids end it and add no
    text; a stop string must end in the text of a token past min_tokens; it ends the tokens at the one that
    completes it and the text before it; when one token completes several, the one that ends first wins,
    then list order. `include_stop`: the ending token's or string's text is kept (include_stop_str_in_output).
    """

    def __init__(self, tokenizer, eos: list[int] | tuple[int, ...], max_new: int, min_tokens: int, stop: list[str],
                 stop_ids: tuple[int, ...] = (), include_stop: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.text = IncrementalText(tokenizer, skip_special_tokens=skip_special_tokens,
                                    spaces_between_special_tokens=spaces_between_special_tokens)
        self.eos, self.max_new, self.min_tokens, self.stop = set(eos), max_new, min_tokens, stop
        self.stop_ids = set(stop_ids) - self.eos
        self.include_stop = include_stop
        self.count = 0  # tokens kept
        self.cut: int | None = None  # the text's end once a stop string matched
        self.released = 0  # characters handed out
        # what may yet begin a stop string (kept text need not wait for the string's end)
        self.holdback = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self.finish_reason: str | None = None
        self.matched_stop: int | str | None = None

    def extend(self, tokens: list[int]) -> list[int]:
        """Add tokens up to and including the one that ends the generation; return those kept."""
        for i, token in enumerate(tokens):
            self._add(token)
            if self.finish_reason:
                return tokens[:i + 1]
        return tokens

    def release(self) -> str:
        """The text not yet handed out that no later token can take back."""
        if self.finish_reason:
            end = len(self.text.text) if self.cut is None else self.cut
        else:
            end = max(self.released, len(self.text.text) - self.holdback)
        delta = self.text.text[self.released:end]
        self.released = end
        return delta

    def _add(self, token: int) -> None:
        self.count += 1
        ending = token in self.eos or token in self.stop_ids  # the decoder masks both before min_tokens
        if ending and not self.include_stop:
            self._finish("stop", token)
            return
        old = len(self.text.text)
        text = self.text.push(token)
        hit = first_stop(text, old, self.stop) if self.count > self.min_tokens else None
        if ending and hit is None:
            self._finish("stop", token)
        elif hit is not None:
            start, string = hit
            self.cut = start + len(string) if self.include_stop else start
            self._finish("stop", string)
        elif self.count == self.max_new:
            self._finish("length", None)

    def _finish(self, reason: str, matched: int | str | None) -> None:
        self.finish_reason, self.matched_stop = reason, matched
        if self.cut is None:
            self.text.flush()


def first_stop(text: str, old: int, stop: list[str]) -> tuple[int, str] | None:
    """(start, string) of the stop string that ends first past `old`; ties go to list order."""
    hits = [(i + len(s), k, i, s) for k, s in enumerate(stop) if (i := text.find(s, max(0, old - len(s) + 1))) >= 0]
    if not hits:
        return None
    _, _, start, string = min(hits)
    return start, string


class IncrementalText:
    """Detokenize a few ids per token; re-decoding everything would cost O(length) each time.

    New text = decode(ids[prefix:]) minus decode(ids[prefix:read]), as vLLM and TGI do: the previous
    token gives context to tokenizers that drop a leading space at the start of a decode, and text
    ending in an incomplete UTF-8 character waits for the tokens that complete it.
    """

    def __init__(self, tokenizer, **decode: bool):
        self.tokenizer, self.decode = tokenizer, {"skip_special_tokens": True, **decode}
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""

    def push(self, token: int) -> str:
        """Add a token; return the whole text so far, minus a trailing incomplete UTF-8 character."""
        self.ids.append(token)
        self._decode(final=False)
        return self.text

    def flush(self) -> None:
        """The end: take what is held back, incomplete character and all."""
        if self.read < len(self.ids):
            self._decode(final=True)

    def _decode(self, final: bool) -> None:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read], **self.decode)
        after = self.tokenizer.decode(self.ids[self.prefix:], **self.decode)
        if final or (len(after) > len(before) and not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
