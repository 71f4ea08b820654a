"""Every config dataclass's fields checked against their own annotations, first thing in __post_init__.

A value of the wrong type (16.5 pages, the string "false" where a bool is meant, null for a path, nan
seconds) is a ValueError naming `section.option`, the value and what was expected, rather than a
traceback later or a setting silently applied wrongly. The rules, by annotation:

    int      an integer, not a bool (numpy integers pass)       bool   true or false only
    float    a finite number (an integer passes), not a bool    str    a string
    X | None X, or null                                         dict   a mapping
    tuple[X, ...]  a list or tuple of X (tuple[str, ...] also one string, as the fields that take it read it)
    an enum        a member, or a string (the dataclass checks which)
    a dataclass    an instance, or a mapping (the dataclass builds it)

and every number is >= 0 (sizes, counts, durations, ports) unless the field is named in `signed`. What a
value means (a port's range, a choice among names) stays each dataclass's own check. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
import types
import typing

PLURALS = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}


@functools.cache
def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def check_field_types(config: object, section: str, signed: tuple[str, ...] = ()) -> None:
    """ValueError naming `section.field` for the first field whose value its annotation does not allow,
    or a negative number in a field not named in `signed`."""
    hints = _hints(type(config))
    for option in dataclasses.fields(config):  # type: ignore[arg-type]
        value, hint = getattr(config, option.name), hints[option.name]
        if not _matches(value, hint):
            raise ValueError(
                f"{section}.{option.name} must be {describe(hint)}, got {value!r}{_quoting_hint(value, hint)}"
            )
        if option.name not in signed and _is_number(value) and value < 0:
            raise ValueError(f"{section}.{option.name} must be >= 0, got {value!r}")


def _quoting_hint(value: object, hint: object) -> str:
    """Text YAML read as a list or mapping ("[::1]", "{a}") where a string is wanted: say to quote it."""
    if isinstance(value, (list, dict)) and _matches("text", hint):
        return " (YAML reads [...] and {...} as a list or mapping: quote the value, e.g. --set 'key=\"[::1]\"')"
    return ""


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _matches(value: object, hint: object) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return _is_number(value) and math.isfinite(value)  # type: ignore[arg-type]
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        item = _tuple_item(hint)
        if isinstance(value, str):
            return item is str
        return isinstance(value, (list, tuple)) and all(_matches(element, item) for element in value)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, (hint, str))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return isinstance(value, (hint, dict))
    raise TypeError(f"check_field_types cannot check a field annotated {hint!r}")


def _tuple_item(hint: object) -> object:
    args = typing.get_args(hint)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"check_field_types checks tuple[X, ...] only, not {hint!r}")
    return args[0]


def describe(hint: object) -> str:
    """What a value of this annotation must be, in words."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        words = [describe(arm) for arm in arms if arm is not type(None)] + ["null"] * (type(None) in arms)
        return " or ".join(dict.fromkeys(" or ".join(words).split(" or ")))  # once each
    if origin is tuple:
        item = _tuple_item(hint)
        plural = f"a list of {PLURALS.get(item, describe(item))}"  # type: ignore[call-overload]
        return f"a string or {plural}" if item is str else plural
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(str(member.value) for member in hint)
    return {
        bool: "true or false",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        dict: "a mapping",
    }.get(hint, "a mapping")  # type: ignore[call-overload]
