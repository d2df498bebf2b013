"""Build a `Config` from an optional YAML file plus dotted `key=value` overrides, checking every key and type."""

from __future__ import annotations

import contextlib
import dataclasses
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from ..errors import ConfigError
from .normalise import normalise
from .schema import Config

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class Problems:
    """Every problem found while loading one config, so that they are reported together, grouped."""

    GROUPS = ("unknown keys", "not supported by posttrain", "wrong values", "settings that do not fit together",
              "files, models and packages")

    def __init__(self):
        self.items: dict[str, list[str]] = {g: [] for g in self.GROUPS}

    def add(self, group: str, message: str) -> None:
        if message not in self.items[group]:
            self.items[group].append(message)

    def update(self, other: Problems) -> None:
        for group, messages in other.items.items():
            for message in messages:
                self.add(group, message)

    def __len__(self) -> int:
        return sum(len(v) for v in self.items.values())

    def raise_if_any(self) -> None:
        if not len(self):
            return
        if len(self) == 1:
            raise ConfigError(next(m for v in self.items.values() for m in v))
        lines = [f"{len(self)} problems; nothing was started:"]
        for group, messages in self.items.items():
            if messages:
                lines.append(f"  {group}:")
                lines += [f"    - {m}" for m in messages]
        raise ConfigError("\n".join(lines))


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


def default_of(key: str) -> Any:
    """The schema's default value of a dotted leaf key."""
    node: Any = Config()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _section_class(section: str):
    """The dataclass of a dotted section ('' = the root), or None if the schema has no such section."""
    cls = Config
    for part in section.split(".") if section else []:
        tp = _hints(cls).get(part)
        if not dataclasses.is_dataclass(tp):
            return None
        cls = tp
    return cls


def _edit_distance(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def suggest(key: str) -> str:
    """A close key of the same section ('Did you mean ...?'); otherwise the keys that section has."""
    parts = key.split(".")
    known = 0  # how many leading segments name a section of the schema
    while known < len(parts) - 1 and _section_class(".".join(parts[:known + 1])) is not None:
        known += 1
    section, name = ".".join(parts[:known]), parts[known]
    names = list(_hints(_section_class(section)))
    limit = 1 if len(name) < 6 else 2
    close = sorted((d, n) for n in names if (d := _edit_distance(name, n)) <= limit)
    if close:
        return f" Did you mean '{'.'.join([*parts[:known], close[0][1]])}'?"
    where = f"'{section}'" if section else "the top level"
    return f" {where} has: {', '.join(names)}."


def unknown_key_message(key: str) -> str:
    return f"unknown config key '{key}'.{suggest(key)}"


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


class _Loading:
    """The state of one load: the tree being built, its problems, and notes on accepted foreign keys."""

    def __init__(self):
        self.tree: dict = {}
        self.problems = Problems()
        self.notes: dict[str, list[str]] = {}  # why -> keys

    def set(self, dotted: str, value: Any) -> None:
        self._set(self.tree, Config, dotted, value, "")

    def _foreign(self, full: str, value: Any) -> bool:
        """Apply the key table to a key posttrain's schema does not have; False if no rule covers it."""
        from .keytable import allowed, choice, find_rule

        found = find_rule(full)
        if found is None:
            return False
        rule, captured = found
        if rule.kind == "map":
            self.notes.setdefault(f"read as posttrain's keys ({rule.why})", []).append(
                f"{full} -> {rule.target.format(*captured)}")
            self.set(rule.target.format(*captured), value)
        elif rule.kind == "choose":
            sets = choice(rule, value)
            if sets is None:
                self.problems.add("not supported by posttrain", f"{full}={value!r} is not supported: {rule.why}")
            else:
                self.notes.setdefault(f"read as posttrain's keys ({rule.why})", []).append(
                    f"{full}={value} -> {', '.join(sets) or 'no key changes'}")
                for key, v in (parse_override(o) for o in sets):
                    self.set(key, v)
        elif rule.kind == "only" and not allowed(rule, value):
            self.problems.add("not supported by posttrain", f"{full}={value!r} is not supported: {rule.why}")
        elif rule.kind == "note":
            self.notes.setdefault(rule.why, []).append(full)
        return True

    def _set(self, tree: dict, cls, dotted: str, value: Any, prefix: str) -> None:
        head, _, rest = dotted.partition(".")
        hints = _hints(cls)
        full = f"{prefix}{head}"
        if head not in hints:
            key = f"{full}.{rest}" if rest else full
            if isinstance(value, dict) and value and not self._foreign(key, value):
                for k, v in value.items():  # a section of a foreign tree: decide each of its keys
                    self._set(tree, cls, f"{dotted}.{k}", v, prefix)
            elif not isinstance(value, dict) or not value:
                if not self._foreign(key, value):
                    self.problems.add("unknown keys", unknown_key_message(key))
            return
        tp = hints[head]
        if dataclasses.is_dataclass(tp):
            if rest:
                self._set(tree.setdefault(head, {}), tp, rest, value, full + ".")
            elif isinstance(value, dict):
                for k, v in value.items():
                    self._set(tree.setdefault(head, {}), tp, str(k), v, full + ".")
            else:
                self.problems.add("wrong values", f"config key '{full}' is a section; set its keys "
                                                  f"({full}.<key>=...) or give a mapping")
            return
        is_dict = typing.get_origin(tp) is dict or tp is dict
        if rest and not is_dict:
            key = f"{full}.{rest}"
            if not self._foreign(key, value):
                self.problems.add("unknown keys", unknown_key_message(key))
        elif rest:  # a key inside a free-form dict field such as override_config
            if self._foreign(f"{full}.{rest}", value):
                return
            target = tree.setdefault(head, {})
            if not isinstance(target, dict):
                tree[head] = target = {}
            *parents, leaf = rest.split(".")
            for p in parents:
                target = target.setdefault(p, {})
            target[leaf] = value
        elif is_dict and isinstance(value, dict):
            tree.setdefault(head, {})
            for k, v in value.items():  # merge, so that mapped entries and the field's own entries combine
                self._set(tree, cls, f"{head}.{k}", v, prefix)
        else:
            tree[head] = value

    def build(self, cls=Config, tree: dict | None = None, prefix: str = ""):
        tree = self.tree if tree is None else tree
        kwargs = {}
        for name, tp in _hints(cls).items():
            if name not in tree:
                continue
            key = f"{prefix}{name}"
            if dataclasses.is_dataclass(tp):
                kwargs[name] = self.build(tp, tree[name], key + ".")
                continue
            if tp is bool and tree[name] == "":  # `key=` (an unset shell variable): Hydra gives "", which verl's
                # `if cfg.key:` reads as False
                self.notes.setdefault("read as posttrain's keys (an empty value, which verl's checks read as False)",
                                      []).append(f"{key}= -> False")
                tree[name] = False
            try:
                kwargs[name] = coerce(tree[name], tp, key)
            except ConfigError as e:
                self.problems.add("wrong values", str(e))
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


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a ConfigError naming the file and the place for bad UTF-8 or bad YAML."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file '{path}' is not UTF-8 text: byte {e.start} (line {line}) is "
                          f"{raw[e.start:e.start + 1]!r}; save the file as UTF-8") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e)
        context, start = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and start is not None:
            what += f" ({context} at line {start.line + 1})"
        raise ConfigError(f"config file '{path}' is not valid YAML{where}: {what}") from None


FAMILIAR_CONFIGS = {"ppo_trainer": [], "ppo_megatron_trainer": ["actor_rollout_ref.actor.strategy=megatron",
                                                                "critic.strategy=megatron"]}


def familiar_defaults(path: Path, defaults) -> list[str]:
    """A YAML file's Hydra `defaults` list, when it names only the familiar trees (posttrain's defaults, see
    hydra_config) and `_self_` (the file's own keys, last when not listed, as Hydra places it); else a ConfigError."""
    entries = defaults if isinstance(defaults, list) else [defaults]
    names = [e[:-5] if isinstance(e, str) and e.endswith(".yaml") else e for e in entries]
    other = [n for n in names if not isinstance(n, str) or n != "_self_" and n not in FAMILIAR_CONFIGS]
    if other:
        raise ConfigError(f"config file '{path}' has a Hydra 'defaults' list with {other}; posttrain reads one file "
                          f"on top of {' or '.join(FAMILIAR_CONFIGS)}: put the other keys in it (or pass them as "
                          "key=value overrides)")
    return names if "_self_" in names else [*names, "_self_"]


def hydra_config(config_path: str | None, config_name: str | None) -> tuple[str | None, list[str]]:
    """`--config-path/--config-name` of the familiar command lines: the two stock trees are posttrain's defaults
    (the Megatron one with strategy=megatron); another name is a YAML file in config_path."""
    if not config_name:
        return None, []
    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    if name in FAMILIAR_CONFIGS:
        return None, list(FAMILIAR_CONFIGS[name])
    path = Path(config_path or ".") / f"{name}.yaml"
    if path.is_file():
        return str(path), []
    raise ConfigError(f"--config-name={config_name}: not {' or '.join(FAMILIAR_CONFIGS)}, and {path} does not exist")


def load_config(config_file: str | None = None, overrides: list[str] | tuple = (), validate: bool = True,
                adjust=None) -> Config:
    """Defaults, then the YAML file, then overrides in order. Every unknown key, wrong type and (with `validate`)
    inconsistent setting is collected and reported in one ConfigError. Accepted foreign keys leave notes in
    `cfg.port_notes` (why -> keys). `adjust(cfg)` runs first (e.g. to adopt torchrun's layout), then normalise.py
    settles the values that have several spellings, then validation reads the result."""
    load = _Loading()
    if config_file:
        path = resolve_config_file(config_file)
        data = read_yaml(path)
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
        if "hydra" in data:  # Hydra's own settings (searchpath, run dir): there is no Hydra here
            load.notes.setdefault("Hydra's own settings; posttrain reads this one file", []).append("hydra")
        own = [(str(key), value) for key, value in data.items() if key not in ("defaults", "hydra")]
        for entry in familiar_defaults(path, data.get("defaults", ["_self_"])):
            for key, value in own if entry == "_self_" else [parse_override(o) for o in FAMILIAR_CONFIGS[entry]]:
                load.set(key, value)
    for item in overrides:
        if not item.strip():
            continue  # an empty argument, e.g. from an unset shell variable
        try:
            key, value = parse_override(item)
        except ConfigError as e:
            load.problems.add("wrong values", str(e))
            continue
        load.set(key, value)
    cfg = load.build()
    cfg.port_notes = load.notes
    if adjust is not None and not len(load.problems):
        adjust(cfg)
    normalise(cfg)
    if validate:
        from .validate import config_problems

        load.problems.update(config_problems(cfg))
    load.problems.raise_if_any()
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=120)
