"""Errors raised across packages. A leaf: it imports nothing of posttrain, so any package may raise them."""


class ConfigError(ValueError):
    """A config that cannot run; the message names every key at fault and what to do."""
