"""Plain data: the only values that cross between a sandboxed program and the code scorer (as JSON text).

`encode` turns None, bool, int, float, complex, str, bytes, list, tuple, dict, set and frozenset values (nested) into
JSON-ready data, tagging the types JSON lacks; `decode` builds values of exactly those built-in types back. A value
that crosses therefore carries no behaviour of its own: an object with an always-true `__eq__`, or an int subclass
that equals everything, arrives as the plain value it holds (or not at all). Set elements are encoded in a fixed
order, so equal values give the same text (`call_key`) in every process whatever its hash seed.

This file imports only the standard library: its source is also copied into the programs run in the sandbox.
"""

import json

_TAGS = ("tuple", "set", "frozenset", "dict", "bytes", "complex")
_MAX_DEPTH = 64


class NotPlain(ValueError):
    """A value (or a received text) that is not plain data."""


def encode(value, _depth=0):
    """JSON-ready data for a plain value; NotPlain for anything else (a function, an instance of a user class)."""
    if _depth > _MAX_DEPTH:
        raise NotPlain("nested too deeply")
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        return {"complex": [complex.__complex__(value).real, complex.__complex__(value).imag]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    inner = _depth + 1
    if isinstance(value, list):
        return [encode(v, inner) for v in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"tuple": [encode(v, inner) for v in tuple.__iter__(value)]}
    if isinstance(value, (set, frozenset)):
        items = sorted((encode(v, inner) for v in value), key=_text)
        return {"frozenset" if isinstance(value, frozenset) else "set": items}
    if isinstance(value, dict):
        return {"dict": [[encode(k, inner), encode(v, inner)] for k, v in dict.items(value)]}
    raise NotPlain(f"a {type(value).__name__} is not plain data")


def decode(data, _depth=0):
    """The plain value `encode` gave `data` for, built from built-in types only; NotPlain for anything malformed."""
    if _depth > _MAX_DEPTH:
        raise NotPlain("nested too deeply")
    if data is None or type(data) in (bool, int, float, str):
        return data
    inner = _depth + 1
    if type(data) is list:
        return [decode(v, inner) for v in data]
    if type(data) is not dict or len(data) != 1 or next(iter(data)) not in _TAGS:
        raise NotPlain(f"not encoded plain data: {str(data)[:80]}")
    tag, body = next(iter(data.items()))
    try:
        if tag == "bytes":
            return bytes.fromhex(body)
        if tag == "complex":
            real, imag = body
            return complex(float(real), float(imag))
        if type(body) is not list:
            raise NotPlain(f"{tag}: not a list")
        if tag == "dict":
            return {decode(k, inner): decode(v, inner) for k, v in body}
        items = [decode(v, inner) for v in body]
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    except (TypeError, ValueError) as e:  # unhashable keys, bad pairs, bad hex
        raise NotPlain(f"{tag}: {e}") from None


def _text(data) -> str:
    return json.dumps(data, separators=(",", ":"))


def call_key(name, args_data, kwargs_data) -> str:
    """One text per call (a function's name and its encoded arguments), the same in every process."""
    return _text([name, args_data, kwargs_data])


def loads(text):
    """JSON text as data (no value other than JSON's own)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise NotPlain(f"not JSON: {e}") from None
