"""The few verl modules a user's file may import that posttrain supplies where verl itself is not installed: the
sampler interfaces (`verl.experimental.dataset.sampler`, data/sampler.py), the dataset base class
(`verl.utils.dataset` and `verl.utils.dataset.rl_dataset`, data/custom_dataset.py), and the tool interface a tool
class is written against (`verl.tools.base_tool`, `verl.tools.schemas`, `verl.utils.rollout_trace`,
tools/verl_base.py; `verl.tools.sandbox_fusion_tools`, tools/verl_sandbox.py; `verl.tools.function_tool`,
tools/function.py). They answer only while a user's module loads (or its class is built), and nothing is left in
sys.modules afterwards; with verl installed, its own modules answer.

The answers are named here by module name and imported only when a user's module imports them: the tool modules sit
above `data` in the layers (docs/architecture.md), and a file that loads a sampler or a dataset class imports no
tool module unless it asks for one (the ReTool recipe's file holds its dataset class and its tool class together)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys

SUPPLIED = {"verl.experimental.dataset.sampler": "posttrain.data.sampler",
            "verl.utils.dataset": "posttrain.data.custom_dataset",
            "verl.utils.dataset.rl_dataset": "posttrain.data.custom_dataset",
            "verl.tools.base_tool": "posttrain.tools.verl_base",
            "verl.tools.schemas": "posttrain.tools.verl_base",
            "verl.utils.rollout_trace": "posttrain.tools.verl_base",
            "verl.tools.sandbox_fusion_tools": "posttrain.tools.verl_sandbox",
            "verl.tools.function_tool": "posttrain.tools.function"}


def supplied(module: str) -> bool:
    """Whether `import module` works in a user's file here without verl (posttrain answers it)."""
    return module in SUPPLIED or any(name.startswith(module + ".") for name in SUPPLIED)


class _Answers(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the supplied names for the import system: each a module of its own holding the names of posttrain's
    module that answers it, and the packages above them (`verl.utils.dataset` is both), empty."""

    def find_spec(self, name, path=None, target=None):
        if not supplied(name):
            return None
        return importlib.util.spec_from_loader(name, self, is_package=any(n.startswith(name + ".") for n in SUPPLIED))

    def create_module(self, spec):
        return None  # a plain module

    def exec_module(self, module):
        if module.__name__ in SUPPLIED:
            ours = importlib.import_module(SUPPLIED[module.__name__])
            module.__dict__.update({k: v for k, v in vars(ours).items() if not k.startswith("__")})


_ANSWERS = _Answers()


@contextlib.contextmanager
def verl_imports_answered():
    if _ANSWERS in sys.meta_path or importlib.util.find_spec("verl") is not None:  # answered already, or verl's own
        yield
        return
    before = {name for name in sys.modules if name == "verl" or name.startswith("verl.")}
    sys.meta_path.insert(0, _ANSWERS)
    try:
        yield
    finally:
        sys.meta_path.remove(_ANSWERS)
        for name in [n for n in sys.modules if (n == "verl" or n.startswith("verl.")) and n not in before]:
            sys.modules.pop(name, None)
