"""The config tree: typed dataclasses (schema), YAML + dotted overrides (loader), consistency checks (validate)."""

from .loader import ConfigError, all_keys, hydra_config, load_config, parse_override, parse_value, to_dict, to_yaml
from .schema import Config
from .validate import config_warnings, validate_config

__all__ = ["Config", "ConfigError", "all_keys", "config_warnings", "hydra_config", "load_config", "parse_override",
           "parse_value", "to_dict", "to_yaml", "validate_config"]
