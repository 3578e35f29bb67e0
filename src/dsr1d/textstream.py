"""Streaming text out of token ids: UTF-8-safe incremental decoding and the think split.

DeepSeek-R1 answers after a reasoning block: the generation prompt ends with ``<think>\\n``, the
model reasons, writes ``</think>``, then answers. Pieces are labelled ``reasoning`` until the
closing tag and ``answer`` after it; the tag itself belongs to neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns a growing list of ids into text pieces that never split a UTF-8 character.

    Byte-level BPE can spread one character over several tokens; decoding a prefix then ends in
    U+FFFD. Text is only released once it no longer ends in one (the approach of TGI and vLLM:
    decode a short window before the new tokens and emit what grew).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0      # start of the window decoded for context
        self.read = 0        # ids before this are already emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if text.endswith(REPLACEMENT) or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """What is left at the end (a dangling partial character stays as U+FFFD)."""
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]


@dataclass
class ThinkSplitter:
    """Labels streamed text as reasoning or answer; holds back text that may be a tag."""

    in_reasoning: bool = True
    reasoning: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    _pending: str = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Pieces ``(kind, text)`` ready to show, kind ``reasoning`` or ``answer``."""
        self._pending += text
        out: list[tuple[str, str]] = []
        while self._pending:
            tag = THINK_CLOSE if self.in_reasoning else THINK_OPEN
            index = self._pending.find(tag)
            if index >= 0:
                self._emit(out, self._pending[:index])
                self._pending = self._pending[index + len(tag):]
                self.in_reasoning = not self.in_reasoning
                continue
            keep = _partial_suffix(self._pending, tag)
            self._emit(out, self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, self._pending)
        self._pending = ""
        return out

    def _emit(self, out: list[tuple[str, str]], text: str) -> None:
        if not text:
            return
        kind = "reasoning" if self.in_reasoning else "answer"
        (self.reasoning if self.in_reasoning else self.answer).append(text)
        out.append((kind, text))

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning).strip()

    @property
    def answer_text(self) -> str:
        return "".join(self.answer).strip()


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def emit(text: str, splitter: ThinkSplitter, on_text: Callable[[str], None] | None,
         final: bool = False) -> None:
    """Feed the splitter and stream the raw text (``</think>`` included, so clients can split
    it too)."""
    splitter.feed(text)
    if final:
        splitter.finish()
    if text and on_text:
        on_text(text)
