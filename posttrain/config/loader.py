"""Build a `Config` from an optional YAML file plus dotted `key=value` overrides, checking every key and type."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from .schema import Config

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class ConfigError(ValueError):
    """A config that cannot run; the message names the key and what to do."""


# ------------------------------------------------------------------ key tree


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema."""
    keys = []
    for name, tp in _hints(cls).items():
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            keys.extend(all_keys(tp, path + "."))
        else:
            keys.append(path)
    return keys


def suggest(key: str) -> str:
    """' Did you mean ...?' for a mistyped dotted key, or ''."""
    keys = all_keys()
    section, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == section]
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6) or difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close and leaf:
        close = [k for k in keys if k.rpartition(".")[2] == leaf][:1]
    return f" Did you mean '{close[0]}'?" if close else ""


def unknown_key_error(key: str) -> ConfigError:
    from .validate import unsupported_key_message

    reason = unsupported_key_message(key)
    if reason:
        return ConfigError(f"config key '{key}' is not supported by posttrain: {reason}")
    return ConfigError(f"unknown config key '{key}'.{suggest(key)}")


# ------------------------------------------------------------------ values


def parse_value(text: str) -> Any:
    """Parse an override value the way these command lines write them: YAML scalars, lists, True/False, null."""
    text = text.strip()
    if text == "":
        return ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {type(None): "null", list: "list", dict: "dict"}.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value: Any, tp, key: str) -> Any:
    """Check (and gently convert: '1e-6' -> float, 'None' -> null) a value against the annotated type."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin is Union:
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value in ("None", "null", "~") and type(None) in args):
            if type(None) in args:
                return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")
    if origin in (list, dict):
        tp = origin
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif tp in (int, float) and not isinstance(value, bool):
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                return tp(value)
        elif isinstance(value, int) or (isinstance(value, float) and (tp is float or value.is_integer())):
            return tp(value)
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif tp is list:
        if isinstance(value, (list, tuple)):
            return list(value)
    elif tp is dict:
        if isinstance(value, dict):
            return value
    raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")


# ------------------------------------------------------------------ merging


def _set(tree: dict, cls, dotted: str, value: Any, prefix: str = "") -> None:
    """Set a dotted key in a nested dict shaped like `cls`, rejecting keys the schema does not have."""
    head, _, rest = dotted.partition(".")
    hints = _hints(cls)
    full = f"{prefix}{head}"
    if head not in hints:
        raise unknown_key_error(f"{full}.{rest}" if rest else full)
    tp = hints[head]
    if dataclasses.is_dataclass(tp):
        if rest:
            _set(tree.setdefault(head, {}), tp, rest, value, full + ".")
        elif isinstance(value, dict):
            for k, v in value.items():
                _set(tree.setdefault(head, {}), tp, str(k), v, full + ".")
        else:
            raise ConfigError(f"config key '{full}' is a section; set its keys ({full}.<key>=...) or give a mapping")
    else:
        if rest and not (typing.get_origin(tp) is dict or tp is dict):
            raise unknown_key_error(f"{full}.{rest}")
        if rest:  # a key inside a free-form dict field such as override_config
            tree.setdefault(head, {})
            target = tree[head]
            *parents, leaf = rest.split(".")
            for p in parents:
                target = target.setdefault(p, {})
            target[leaf] = value
        else:
            tree[head] = value


def _build(cls, tree: dict, prefix: str = ""):
    kwargs = {}
    for name, tp in _hints(cls).items():
        if name not in tree:
            continue
        key = f"{prefix}{name}"
        kwargs[name] = _build(tp, tree[name], key + ".") if dataclasses.is_dataclass(tp) else coerce(tree[name], tp, key)
    return cls(**kwargs)


def resolve_config_file(name_or_path: str) -> Path:
    """A YAML path, or the name of a recipe shipped with the package (`--config grpo`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    recipe = RECIPES_DIR / f"{name_or_path}.yaml"
    if recipe.is_file():
        return recipe
    recipes = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError(f"config file '{name_or_path}' not found (not a file, not a recipe; recipes: {recipes})")


def parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, _, text = item.partition("=")
    key = key.strip()
    if key.startswith("~"):
        raise ConfigError(f"override '{item}': deleting keys (~key) is not supported; set the key to null instead")
    return key.lstrip("+"), parse_value(text)


def load_config(config_file: str | None = None, overrides: list[str] | tuple = (), validate: bool = True) -> Config:
    """Defaults, then the YAML file, then overrides in order; unknown keys and wrong types fail here."""
    tree: dict = {}
    if config_file:
        path = resolve_config_file(config_file)
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
        for key, value in data.items():
            _set(tree, Config, str(key), value)
    for item in overrides:
        key, value = parse_override(item)
        _set(tree, Config, key, value)
    cfg = _build(Config, tree)
    if validate:
        from .validate import validate_config

        validate_config(cfg)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)
