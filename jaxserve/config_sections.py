"""YAML config files as sections of frozen dataclasses, one loader for the server and the router.

A file is a mapping of sections; `--set section.key=value` overrides one key (its value read as YAML, or
kept as the string given when it is not YAML, such as a jinja template);
every section and key is checked, and a bad one is a ValueError naming it. Imports no JAX: the router
process loads its config with this too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import yaml


def read_yaml(path: str) -> object:
    """A config file's YAML (an empty file is {}); a missing or malformed file is a ValueError naming it."""
    try:
        with open(path) as f:
            return yaml.safe_load(f) or {}
    except OSError as error:
        raise ValueError(f"cannot read config file {path}: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"malformed YAML in {path}: {error}") from None


def parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--set expects KEY=VALUE, got {text!r}")
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError:  # not YAML ('{% for m in messages %}...', '@keys'): the string itself
        return key.strip(), value


def read_sections(
    path: str | None,
    overrides: list[str] | tuple[str, ...],
    section_names: tuple[str, ...],
    also_in: Callable[[str, str], Iterable[str]] = lambda section, name: (),
) -> dict[str, object]:
    """The file's sections with the overrides applied; a section absent from both is absent here.
    also_in(section, name): the other sections that may hold the same option (the server's `engine:` and
    the group sections); an override replaces the option there too, wherever the file put it."""
    tree = read_yaml(path) if path is not None else {}
    if not isinstance(tree, dict):
        raise ValueError(f"config file {path} must hold a mapping of sections")
    for section in tree:
        if section not in section_names:
            raise ValueError(f"unknown config section {section!r}; expected {', '.join(section_names)}")
    for override in overrides:
        key, value = parse_override(override)
        section, _, name = key.partition(".")
        if section not in section_names:
            raise ValueError(
                f"unknown config key {key!r}; keys look like section.name, sections: {', '.join(section_names)}"
            )
        if not name or "." in name:
            raise ValueError(f"--set expects SECTION.KEY=VALUE, got {override!r}")
        values = tree.setdefault(section, {})
        if values is None:
            values = tree[section] = {}
        if not isinstance(values, dict):
            raise ValueError(f"--set {key}: config section {section!r} is not a mapping")
        for other in also_in(section, name):
            if isinstance(tree.get(other), dict):
                tree[other].pop(name, None)  # type: ignore[union-attr]
        values[name] = value
    return tree


def section_values(name: str, values: object) -> dict:
    """A mapping section's values (an empty section is {})."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"config section {name!r} must be a mapping, got {values!r}")
    return dict(values)


def build_section(cls, name: str, values: object, exclude: frozenset[str] = frozenset()):
    """cls(**values) for a dataclass section, every key checked; `exclude` names fields set elsewhere."""
    values = section_values(name, values)
    known = {f.name for f in dataclasses.fields(cls)} - exclude
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown config key {name}.{unknown[0]}; known: {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except TypeError as error:
        raise ValueError(f"config section {name!r}: {error}") from None
