"""Names from traces, summaries and the live stream made safe to write to a terminal.

A host, kernel, module or job name is data from a file or a socket: an escape sequence in it
(`ESC[2J` clears the screen, `ESC]0;...BEL` retitles the window, `ESC]8;;URL` makes a link) must
reach the terminal as text, never as a command. `printable(text)` writes every control character
(C0 but newline and tab, DEL, C1) and every bidirectional override or isolate (which reorder
what is shown, "Trojan Source") as a visible escape (`\\x1b`, `\\u202e`); everything else,
non-ASCII letters included, is kept. `printable_report` applies it to every string of a Report,
for the text views; the JSON output keeps the names exactly (JSON escapes them itself).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

__all__ = ["printable", "printable_report"]

_C0 = "\x00-\x08\x0b-\x1f"  # C0 controls but tab and newline
_OTHERS = "\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"  # DEL, C1, bidi
_UNSAFE = re.compile(f"[{_C0}{_OTHERS}]")
_UNSAFE_IN_JSON = re.compile(f"\\\\u00[01][0-9a-f]|[{_OTHERS}]")
"""The same characters in msgspec's JSON, which writes C0 controls as \\u00XX (a false match,
such as an escaped backslash before "u001b", only costs a copy)."""


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with its terminal controls and bidi overrides written as visible escapes."""
    return _UNSAFE.sub(_escape, text) if _UNSAFE.search(text) else text


T = TypeVar("T")


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    return value


def printable_report(report: T) -> T:
    """A copy of a msgspec Struct (a Report) whose strings are all `printable`; the same object
    when none needs it (the common case costs one encode)."""
    if not _UNSAFE_IN_JSON.search(msgspec.json.encode(report).decode("utf-8")):
        return report
    return msgspec.convert(_clean(msgspec.to_builtins(report)), type(report))
