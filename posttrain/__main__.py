"""`python -m posttrain ...` runs the same command line as `posttrain ...`."""

from .cli import entry

entry()
