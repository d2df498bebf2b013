"""Built-in example environments (imported here, so importing posttrain.agents registers them)."""

from . import guess_number  # noqa: F401
