"""posttrain's own stateful tools, which the class names of verl's example tool configs load (stateful.VERL_BUILTINS):
a GSM8K and a Geometry3K answer check, a code interpreter, a search over a local corpus."""
