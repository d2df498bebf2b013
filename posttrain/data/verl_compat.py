"""The few verl modules a user's file may import that posttrain supplies where verl itself is not installed: the
sampler interfaces (`verl.experimental.dataset.sampler`, data/sampler.py) and the dataset base class
(`verl.utils.dataset` and `verl.utils.dataset.rl_dataset`, data/custom_dataset.py). They answer only while a user's
module loads (or its class is built), and nothing is left in sys.modules afterwards; with verl installed, its own
modules answer."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types

SUPPLIED = {"verl.experimental.dataset.sampler": "posttrain.data.sampler",
            "verl.utils.dataset": "posttrain.data.custom_dataset",
            "verl.utils.dataset.rl_dataset": "posttrain.data.custom_dataset"}


def supplied(module: str) -> bool:
    """Whether `import module` works in a user's file here without verl (posttrain answers it)."""
    return module in SUPPLIED or any(name.startswith(module + ".") for name in SUPPLIED)


@contextlib.contextmanager
def verl_imports_answered():
    if importlib.util.find_spec("verl") is not None:
        yield
        return
    added = []
    for name, ours in SUPPLIED.items():
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix not in sys.modules:
                sys.modules[prefix] = importlib.import_module(ours) if prefix in SUPPLIED else types.ModuleType(prefix)
                added.append(prefix)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)
