"""The config tree: typed dataclasses documented field by field (schema/), YAML + dotted overrides (loader),
settled values (normalise), consistency checks (validate), notes on keys with no effect here (notes)."""

from .loader import ConfigError, all_keys, hydra_config, load_config, parse_override, parse_value, to_dict, to_yaml
from .notes import config_warnings
from .schema import Config
from .validate import validate_config

__all__ = ["Config", "ConfigError", "all_keys", "config_warnings", "hydra_config", "load_config", "parse_override",
           "parse_value", "to_dict", "to_yaml", "validate_config"]
