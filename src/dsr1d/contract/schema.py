"""Option schemas: every profile key is typed and described; unknown keys are errors.

A parser takes the raw string from the profile and returns the typed value, or raises
``ValueError`` with a reason that a person can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

Parser = Callable[[str], Any]


@dataclass(frozen=True)
class Option:
    """One key of a profile section."""

    parse: Parser
    help: str
    kind: str


Schema = dict[str, Option]


def choice(*values: str) -> Parser:
    """One of ``values``."""

    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(f"{raw!r} is not one of: {', '.join(values)}")
        return raw

    return parse


def integer(lo: int, hi: int) -> Parser:
    """An integer in ``[lo, hi]``; 0x-prefixed hex is accepted."""

    def parse(raw: str) -> int:
        try:
            value = int(raw, 0)
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
        if not lo <= value <= hi:
            raise ValueError(f"{value} is outside {lo}..{hi}")
        return value

    return parse


_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}


def real(lo: float, hi: float) -> Parser:
    """A finite number in ``[lo, hi]``."""

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a number") from None
        if not lo <= value <= hi:      # also false for nan
            raise ValueError(f"{value:g} is outside {lo:g}..{hi:g}")
        return value

    return parse


def boolean(raw: str) -> bool:
    """yes/no, true/false, on/off or 1/0."""
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{raw!r} is not a boolean (yes/no, on/off, true/false, 1/0)")


def word_list(raw: str) -> list[str]:
    """Names separated by commas or spaces."""
    words = [w for w in raw.replace(",", " ").split() if w]
    if not words:
        raise ValueError("expected at least one name")
    return words


def either(first: Parser, second: Parser, what: str) -> Parser:
    """Accept what ``first`` or ``second`` accepts."""

    def parse(raw: str) -> Any:
        for parser in (first, second):
            try:
                return parser(raw)
            except ValueError:
                pass
        raise ValueError(f"{raw!r} is not {what}")

    return parse


def option(parse: Parser, help: str, kind: str | None = None) -> Option:
    """Build an `Option`; ``kind`` is the type as shown in documentation."""
    return Option(parse=parse, help=help, kind=kind or str(getattr(parse, "__name__", "value")))
