"""Categories, sites and module paths of CUDA snapshot allocation stacks.

The category is the best stack rule of the one category table (`categories.py`) that any frame
of the stack matches; a block without frames is `PREEXISTING` (allocated before the history
started). The site is the innermost frame of the user's own Python code (`file:line in name`),
else of a library's Python code (transformers, timm, ... before torch's own), else the innermost
frame; never a CPython or C++ frame while a Python one exists. The module path is the chain of
user `forward` calls the block was allocated under.
"""

from __future__ import annotations

import re
from typing import Any

from zdiag.errors import InputError

from ..inputs.cuda_snapshot import MAX_SNAPSHOT_ITEMS, MAX_STACK_FRAMES
from .categories import PREEXISTING, STACK_RULES, stack_category, stack_rule_rank

MAX_MODULE_DEPTH = 32
"""User `forward` calls kept in a module path (outermost first; deeper ones end in "...")."""
MAX_LABEL_CHARS = 200
"""Characters of a file name or function name kept in a site label."""

_MAX_LINE = 2**62
"""A frame's `line` beyond this is damaged (read as 0)."""

_NOT_USER = ("/torch/", "/site-packages/", "/dist-packages/", "<frozen", "/lib/python3")
_LIBRARY = ("/site-packages/", "/dist-packages/")
_NATIVE_SUFFIXES = (".cpp", ".h", ".c", ".cc", ".cu", ".hpp", ".cxx", ".S")

USER, LIBRARY, FRAMEWORK, NATIVE, NATIVE_OP, NATIVE_OTHER = range(6)
"""Where a frame's code lives, the site's order of preference: the user's own Python, a
library's Python (site-packages, torch aside), torch's or the standard library's Python, then,
for stacks with no Python frame at all (allocations on the autograd engine's threads), the
autograd node (`MeanBackward0`), the aten op (`aten::div_Tensor`), and the rest of the native
frames (the allocator's and the dispatcher's own: least telling)."""
_AUTOGRAD_NODE = re.compile(r"torch::autograd::generated::(\w+)::apply\(")
_ATEN_CALL = re.compile(r"^at::_ops::(\w+)::call\(")


def _native_site(name: str) -> tuple[int, str] | None:
    """(tier, label) of a native frame that names an autograd node or an aten op."""
    m = _AUTOGRAD_NODE.search(name)
    if m is not None:
        return NATIVE, f"{m.group(1)} (autograd, no Python frame)"
    m = _ATEN_CALL.match(name)
    if m is not None:
        return NATIVE_OP, f"aten::{m.group(1)} (no Python frame)"
    return None


def source_tier(filename: str) -> int:
    """USER, LIBRARY, FRAMEWORK or NATIVE_OTHER for a frame's file name."""
    if not filename or filename == "??" or filename.endswith(_NATIVE_SUFFIXES):
        return NATIVE_OTHER
    if not any(p in filename for p in _NOT_USER):
        return USER
    if any(p in filename for p in _LIBRARY) and "/torch/" not in filename:
        return LIBRARY
    return FRAMEWORK


Described = tuple[str, str, str]
"""(category, site, module path) of one stack."""

MAX_STACK_CACHE = 500_000
"""Stacks remembered by frame identity (torch shares frame dicts between stacks)."""


FrameInfo = tuple[int, int, str, str]
"""(rule rank, source tier, site label, module call line or "") of one frame."""

_NOT_A_FRAME: FrameInfo = (len(STACK_RULES), NATIVE_OTHER, "", "")


class Categorizer:
    """Categories, sites and module paths of allocation stacks, within the snapshot's bounds.

    Memoized three times: per stack by the identities of its frame dicts (torch builds every
    stack from one shared table of frames, so a pickle's stacks reuse the same dict objects and
    a stack seen before costs one tuple hash), per frame dict by identity, and per frame by
    (filename, name, line) for the rules and labels (a long file name shared by many frames is
    searched once). A stack is read up to MAX_STACK_FRAMES frames (`truncated` counts the longer
    ones); the frames read, with `charge`'s other items, are bounded by MAX_SNAPSHOT_ITEMS.
    """

    def __init__(self) -> None:
        self._rank: dict[tuple[str, str], int] = {}
        self._stacks: dict[tuple[int, ...], Described] = {}
        self._lists: dict[int, Described] = {}  # by the stack list's own identity
        self._keep: list[list[Any]] = []  # the frames behind cached ids stay alive
        self._frame_ids: dict[int, FrameInfo] = {}
        self._frame_keys: dict[tuple[str, str, int], FrameInfo] = {}
        self.items = 0
        self.truncated = 0

    def charge(self, n: int) -> None:
        """Count `n` more items read (InputError beyond MAX_SNAPSHOT_ITEMS)."""
        self.items += n
        if self.items > MAX_SNAPSHOT_ITEMS:
            raise InputError(
                f"the CUDA memory snapshot holds more than {MAX_SNAPSHOT_ITEMS:,} events, blocks "
                "and stack frames, more than a snapshot is read for (a damaged or hostile file)."
            )

    def describe(self, frames: list[Any]) -> Described:
        """(category, site, module path) of a stack; PREEXISTING without frames."""
        if not frames:
            return (PREEXISTING, "", "")
        got = self._lists.get(id(frames))
        if got is not None:
            return got
        stack = frames
        if len(frames) > MAX_STACK_FRAMES:
            self.truncated += 1
            stack = frames[:MAX_STACK_FRAMES]
        self.charge(len(stack))
        key = tuple(map(id, stack))
        got = self._stacks.get(key)
        if got is None:
            infos = [self._info(f) for f in stack]
            got = (self._category(infos), self._site(infos), self._module_path(infos))
            if len(self._stacks) >= MAX_STACK_CACHE:
                self._stacks.clear()
                self._lists.clear()
                self._keep.clear()
                self._frame_ids.clear()
            self._stacks[key] = got
        self._lists[id(frames)] = got
        self._keep.append(frames)
        return got

    def _info(self, f: Any) -> FrameInfo:
        """One frame's rule rank, user-ness, label and module line (memoized)."""
        got = self._frame_ids.get(id(f))
        if got is not None:
            return got
        if not isinstance(f, dict):
            return _NOT_A_FRAME
        filename, name, line = f.get("filename", ""), f.get("name", "?"), f.get("line", 0)
        # Not str() of a damaged field: a list nested 100k deep would recurse without end.
        filename = filename if isinstance(filename, str) else ""
        name = name if isinstance(name, str) else "?"
        line = line if line.__class__ is int and 0 <= line < _MAX_LINE else 0
        key = (filename, name, line)
        got = self._frame_keys.get(key)
        if got is None:
            tier = source_tier(filename)
            where = f"{_short(filename)}:{line}"
            label = f"{where} in {_clip(name)}"
            native = _native_site(name) if tier == NATIVE_OTHER else None
            if native is not None:
                tier, label = native
            got = (
                self._frame_rank(filename, "" if name == "?" else name),
                tier,
                label,
                where if tier == USER and name == "forward" else "",
            )
            self._frame_keys[key] = got
        self._frame_ids[id(f)] = got
        return got

    def _frame_rank(self, filename: str, name: str) -> int:
        key = (filename, name)
        r = self._rank.get(key)
        if r is None:
            r = self._rank[key] = stack_rule_rank(filename, name)
        return r

    @staticmethod
    def _category(infos: list[FrameInfo]) -> str:
        return stack_category(min((i[0] for i in infos), default=len(STACK_RULES)))

    @staticmethod
    def _site(infos: list[FrameInfo]) -> str:
        """The innermost labelled frame of the most preferred source tier."""
        best, best_tier = "", NATIVE_OTHER + 1
        for _rank, tier, label, _ in infos:  # innermost first
            if label and tier < best_tier:
                best, best_tier = label, tier
                if tier == USER:
                    break
        return best

    @staticmethod
    def _module_path(infos: list[FrameInfo]) -> str:
        chain = [i[3] for i in reversed(infos) if i[3]]
        if len(chain) > MAX_MODULE_DEPTH:
            return " > ".join(chain[:MAX_MODULE_DEPTH]) + " > ..."
        return " > ".join(chain)

    def category(self, frames: list[Any]) -> str:
        """The block's category (PREEXISTING without frames)."""
        if not frames:
            return PREEXISTING
        return self._category([self._info(f) for f in frames[:MAX_STACK_FRAMES]])

    def site(self, frames: list[Any]) -> str:
        """The innermost user frame, `file:line in name`; else a library's, torch's, then the
        innermost native frame (see `source_tier`; "" without frames)."""
        return self._site([self._info(f) for f in frames[:MAX_STACK_FRAMES]])

    def module_path(self, frames: list[Any]) -> str:
        """The chain of user `forward` call lines, outermost first (`model.py:120 >
        model.py:88`): the module call an activation was made under ("" when none); at most
        MAX_MODULE_DEPTH calls."""
        return self._module_path([self._info(f) for f in frames[:MAX_STACK_FRAMES]])


def _clip(text: str) -> str:
    """`text`, its last MAX_LABEL_CHARS characters when longer."""
    return text if len(text) <= MAX_LABEL_CHARS else "..." + text[-MAX_LABEL_CHARS:]


def _short(filename: str) -> str:
    parts = filename[-4 * MAX_LABEL_CHARS :].replace("\\", "/").rsplit("/", 2)
    return _clip("/".join(parts[-2:]) if len(parts) > 1 else parts[0])


def block_frames(block: dict[str, Any]) -> list[Any]:
    """A block's allocation stack: `frames`, else the last `history` entry's (older torch)."""
    frames = block.get("frames")
    if isinstance(frames, list) and frames:
        return frames
    history = block.get("history")
    if isinstance(history, list) and history and isinstance(history[-1], dict):
        old = history[-1].get("frames")
        if isinstance(old, list):
            return old
    return []
