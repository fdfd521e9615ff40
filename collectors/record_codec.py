"""Reading and writing the run directory's JSON records, driven by their dataclass fields.

A record (`run_records.py`) is a frozen dataclass deriving from `JsonRecord`; each field's type
says how it is read, and a few declarations say the rest:

- `at_least(n)`: a whole number below `n` is ignored (with a warning);
- `run_path()`: a path relative to the run directory, never absolute nor climbing out with `..`;
- `not_written()`: kept in memory only (the warnings of a manifest read);
- metadata `WRITTEN_WHEN_SET`: written only when not None/False/(), after the fields always written;
- metadata `nested_sep(": ")`: a record field whose warnings read `<where>: <key>: ...`.

Reading is tolerant: unknown keys are ignored, and a value of the wrong type takes the field's
default (a field without one: its type's zero) and adds a warning naming the key. What a record
needs beyond its fields' types (a rank checked against the world size, a required key) it reads
itself and passes to `JsonRecord.read` as given values.

Standard library only (plus zdiag.errors): the launcher and the analyzers import it without torch.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any, TypeVar

from zdiag.errors import InputError

_MINIMUM = "zdiag_minimum"
_RUN_PATH = "zdiag_run_path"
_WHEN_SET = "zdiag_written_when_set"
_NOT_WRITTEN = "zdiag_not_written"
_NESTED_SEP = "zdiag_nested_sep"

R = TypeVar("R", bound="JsonRecord")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""The whole numbers a record may hold (what JSON writers and the Report encode)."""


# --- field declarations ----------------------------------------------------------------------


def at_least(minimum: int, default: int | None = None) -> Any:
    """A whole-number field whose values below `minimum` are ignored when read."""
    return dataclasses.field(default=default, metadata={_MINIMUM: minimum})


def run_path() -> Any:
    """A run-dir path field (None by default): relative, POSIX, never climbing out with `..`."""
    return dataclasses.field(default=None, metadata={_RUN_PATH: True})


def not_written() -> Any:
    """A tuple field kept in memory only (never written, never compared)."""
    return dataclasses.field(default=(), compare=False, metadata={_NOT_WRITTEN: True})


WRITTEN_WHEN_SET = {_WHEN_SET: True}
"""Metadata of a field written only when set (not None, False or ()), after those always written."""


def nested_sep(sep: str) -> dict[str, str]:
    """Metadata of a record field whose warnings name it `<where><sep><key>` (default `.`)."""
    return {_NESTED_SEP: sep}


# --- tolerant reads of one JSON object -------------------------------------------------------


class Fields:
    """Typed reads of one JSON object; a wrong type gives the default and a warning."""

    def __init__(self, data: Mapping[str, Any], where: str, warnings: list[str]) -> None:
        self.data = data
        self.where = where
        self.warnings = warnings

    def bad(self, key: str, value: Any, what: str) -> None:
        """Warn that `key` holds `value`, which is not `what`; the caller ignores it."""
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        self.warnings.append(f"{self.where}: {key} is {shown}, not {what}; ignored")

    def int_or_none(self, key: str, *, minimum: int | None = None) -> int | None:
        """A whole number (bools are not) that fits 64 bits, at least `minimum` when given;
        else None (the report and the summaries store 64-bit integers)."""
        value = self.data.get(key)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not INT64_MIN <= value <= INT64_MAX
        ):
            self.bad(key, value, "a whole number")
            return None
        if minimum is not None and value < minimum:
            self.bad(key, value, f"a whole number of at least {minimum}")
            return None
        return value

    def float_or_none(self, key: str) -> float | None:
        """A number as a float; else None."""
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.bad(key, value, "a number")
            return None
        try:
            return float(value)
        except OverflowError:  # an integer too large for a float
            self.bad(key, value, "a number")
            return None

    def str_or_none(self, key: str) -> str | None:
        """A string; else None."""
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        self.bad(key, value, "a string")
        return None

    def bool_or_none(self, key: str) -> bool | None:
        """true or false; else None."""
        value = self.data.get(key)
        if value is None or isinstance(value, bool):
            return value
        self.bad(key, value, "true or false")
        return None

    def strs(self, key: str) -> tuple[str, ...]:
        """A list, its items as strings; else ()."""
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, list):
            self.bad(key, value, "a list of strings")
            return ()
        return tuple(str(v) for v in value)

    def obj(self, key: str) -> dict[str, Any] | None:
        """An object; else None."""
        value = self.data.get(key)
        if value is None or isinstance(value, dict):
            return value
        self.bad(key, value, "an object")
        return None

    def relpath(self, key: str) -> str | None:
        """A run-dir path: relative, POSIX, never climbing out with `..` (else ignored)."""
        value = self.str_or_none(key)
        if value is None:
            return None
        pure = PurePosixPath(value)
        if not value or pure.is_absolute() or ".." in pure.parts or "\\" in value:
            self.warnings.append(
                f"{self.where}: {key} {value!r} points outside the run directory; ignored"
            )
            return None
        return value


def as_object(data: Any, where: str) -> Mapping[str, Any]:
    """`data` when it is a JSON object; InputError otherwise."""
    if not isinstance(data, dict):
        raise InputError(f"{where}: not a JSON object; fix or remove it.")
    return data


def show_int(value: int) -> str:
    """An integer for a message: as is, or its digit count when it is absurdly long (never
    converting a huge integer to text, which Python limits to 4300 digits)."""
    if abs(value) < 10**12:
        return str(value)
    sign = "-" if value < 0 else ""
    if value.bit_length() > 10_000:
        return f"{sign}about 2^{value.bit_length()}"
    digits = str(abs(value))
    return f"{sign}{digits[:3]}... ({len(digits)} digits)"


# --- records ----------------------------------------------------------------------------------


class JsonRecord:
    """Base of the run directory's records (frozen dataclasses): `read` and `to_json` from the
    fields. `from_json` reads an object strictly (InputError when not one); records override it
    where they read more than their fields' types say."""

    @classmethod
    def from_json(cls: type[R], data: Any, where: str, warnings: list[str]) -> R:
        """The record of JSON object `data`; InputError when it is not an object."""
        return cls.read(as_object(data, where), where, warnings)

    @classmethod
    def read(
        cls: type[R], data: Mapping[str, Any], where: str, warnings: list[str], **given: Any
    ) -> R:
        """The record of object `data`: the `given` field values as they are, every other field
        (but those `not_written`) read from `data` by its declaration, warnings in field order."""
        f = Fields(data, where, warnings)
        values = {
            fld.name: _read_field(f, fld, kind)
            for fld, kind in _plan(cls)
            if fld.name not in given and not fld.metadata.get(_NOT_WRITTEN)
        }
        return cls(**given, **values)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this record: its fields in order, those `written_when_set` last."""
        first: dict[str, Any] = {}
        last: dict[str, Any] = {}
        for fld in dataclasses.fields(self):  # type: ignore[arg-type]
            if fld.metadata.get(_NOT_WRITTEN):
                continue
            value = getattr(self, fld.name)
            if not fld.metadata.get(_WHEN_SET):
                first[fld.name] = _plain(value)
            elif value is not None and value is not False and value != ():
                last[fld.name] = _plain(value)
        return {**first, **last}


def _plain(value: Any) -> Any:
    if isinstance(value, JsonRecord):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return dict(value)
    return value


@dataclasses.dataclass(frozen=True)
class _Kind:
    """How one field is read: its base type, whether None is allowed, a tuple's item type."""

    base: Any
    optional: bool
    item: Any = None


_Plan = tuple[tuple[dataclasses.Field[Any], _Kind], ...]
_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    """Each field of record class `cls` with how it is read (computed once per class)."""
    if cls in _PLANS:
        return _PLANS[cls]
    hints = typing.get_type_hints(cls)
    plan = []
    for fld in dataclasses.fields(cls):
        tp = hints[fld.name]
        args = typing.get_args(tp)
        optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
        if optional:
            (tp,) = [a for a in args if a is not type(None)]
        origin = typing.get_origin(tp) or tp
        item = typing.get_args(tp)[0] if origin is tuple else None
        plan.append((fld, _Kind(origin, optional, item)))
    _PLANS[cls] = tuple(plan)
    return _PLANS[cls]


def _default(fld: dataclasses.Field[Any], kind: _Kind) -> Any:
    """The field's default; for a field without one, its type's zero."""
    if fld.default is not dataclasses.MISSING:
        return fld.default
    if fld.default_factory is not dataclasses.MISSING:
        return fld.default_factory()
    return None if kind.optional else kind.base()


def _read_field(f: Fields, fld: dataclasses.Field[Any], kind: _Kind) -> Any:
    key, base = fld.name, kind.base
    if isinstance(base, type) and issubclass(base, JsonRecord):
        where = f"{f.where}{fld.metadata.get(_NESTED_SEP, '.')}{key}"
        if kind.optional:  # the record's own from_json says what an absent one is
            return base.from_json(f.data.get(key), where, f.warnings)
        return base.from_json(f.obj(key) or {}, where, f.warnings)
    if base is tuple:
        return _read_tuple(f, key, kind.item)
    value: Any
    if base is bool:
        value = f.bool_or_none(key)
    elif base is int:
        value = f.int_or_none(key, minimum=fld.metadata.get(_MINIMUM))
    elif base is float:
        value = f.float_or_none(key)
    elif base is str:
        value = f.relpath(key) if fld.metadata.get(_RUN_PATH) else f.str_or_none(key)
    elif base is dict:
        value = f.obj(key)
    else:
        raise TypeError(f"{key}: no reader for fields of type {base!r}")
    return _default(fld, kind) if value is None else value


def _read_tuple(f: Fields, key: str, item: Any) -> tuple[Any, ...]:
    if item is str:
        return f.strs(key)
    if not (isinstance(item, type) and issubclass(item, JsonRecord)):
        raise TypeError(f"{key}: no reader for tuples of {item!r}")
    raw = f.data.get(key)
    if raw is not None and not isinstance(raw, list):
        f.bad(key, raw, "a list")
        raw = None
    records = (
        item.from_json(v, f"{f.where}: {key}[{i}]", f.warnings) for i, v in enumerate(raw or [])
    )
    return tuple(r for r in records if r is not None)
