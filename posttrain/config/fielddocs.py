"""What each config key does, read from the string literal written under its field in the schema's dataclasses.

A field's description is the string right under it (whitespace folded, so it may wrap). A section field used in
more than one place (the actor's and the critic's `optim`) may have a string of `key: text` entries under it, which
say what the section's keys mean at that place: `key` is a key of the section (dotted below it, `*` as in fnmatch,
several separated by commas), and a line that does not start with `key:` continues the entry above.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import functools
import inspect
import re
import sys
import typing

from .schema import Config

_ENTRY = re.compile(r"([\w.*]+(?:, [\w.*]+)*): (.*)")


@functools.cache
def _class_bodies(module: str) -> dict[str, list[ast.stmt]]:
    tree = ast.parse(inspect.getsource(sys.modules[module]))
    return {node.name: node.body for node in tree.body if isinstance(node, ast.ClassDef)}


def field_docs(cls) -> dict[str, str]:
    """Field name -> the string literal under it in the class body (as written), for the fields that have one."""
    body = _class_bodies(cls.__module__)[cls.__name__]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = after.value.value
    return docs


def _leaf_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for name, tp in typing.get_type_hints(cls).items():
        keys += _leaf_keys(tp, f"{prefix}{name}.") if dataclasses.is_dataclass(tp) else [f"{prefix}{name}"]
    return keys


def _entries(text: str, cls, where: str) -> list[tuple[str, str]]:
    """A section field's `key: text` entries as (pattern relative to the section, text)."""
    keys = _leaf_keys(cls)
    entries: list[tuple[list[str], list[str]]] = []
    for line in text.strip().splitlines():
        line = line.strip()
        start = _ENTRY.fullmatch(line)
        patterns = start.group(1).split(", ") if start else []
        if patterns and all(fnmatch.filter(keys, p) for p in patterns):
            entries.append((patterns, [start.group(2)]))
        elif entries:
            entries[-1][1].append(line)
        else:
            raise ValueError(f"{where}: the string under a section field holds `key: text` entries, one per key of "
                             f"{cls.__name__}; it starts with {line!r}")
    return [(p, " ".join(words)) for patterns, words in entries for p in patterns]


@functools.cache
def descriptions(root=Config) -> dict[str, str]:
    """Every dotted key of the schema -> what it does, in the schema's order."""
    out: dict[str, str] = {}
    _describe(root, "", [], out)
    return out


def _describe(cls, prefix: str, place: list[tuple[str, str]], out: dict[str, str]) -> None:
    docs = field_docs(cls)
    for name, tp in typing.get_type_hints(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            here = _entries(docs[name], tp, key) if name in docs else []
            _describe(tp, key + ".", place + [(f"{key}.{p}", text) for p, text in here], out)
            continue
        text = next((text for pattern, text in place if fnmatch.fnmatchcase(key, pattern)), docs.get(name, ""))
        text = " ".join(text.split())
        if not text:
            raise ValueError(f"config key {key} has no description: write one under its field in "
                             f"{cls.__module__}.{cls.__name__}")
        out[key] = text
