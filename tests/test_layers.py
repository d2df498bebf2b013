"""posttrain's packages form layers: each imports only the layers below its own, so no import runs upward or closes
a circle across packages, and only `parallel` imports torch.distributed. Every import counts, also one inside a
function. `LAYERS` below is the contract (docs/architecture.md shows it, with the imports as they are:
`python tests/test_layers.py` prints that section)."""

from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. A unit may import the units of the layers below its own, never one of its own layer or above.
# A unit is a package of posttrain (or a top-level module); a dotted name (data.preprocess) is a part of a package
# that sits in a layer of its own. Why each layer sits where it does: docs/architecture.md, "Layers".
LAYERS = [
    ("errors", "progress", "host_memory"),
    ("algo", "parallel"),
    ("models",),
    ("data",),
    ("reward", "rollout"),
    ("tools", "watch"),
    ("serve",),
    ("agents", "config", "roles", "data.preprocess"),
    ("trainer",),
    ("tiny", "report"),
    ("cli",),
    ("__main__",),
]
DISTRIBUTED = "parallel"  # the one unit that may import torch.distributed


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str, units: set[str], package: Path) -> str | None:
    """The longest name in `units` that `module` (posttrain.x.y) lies in; "" for the bare package posttrain and the
    names its __init__ defines; None for a module of posttrain in no unit."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in units:
            return ".".join(parts[:n])
    if not parts or not ((package / parts[0]).is_dir() or (package / f"{parts[0]}.py").is_file()):
        return ""
    return None


def imported(tree: ast.Module, module: str, is_package: bool):
    """(line, module) for every import of `tree`, anywhere in it; relative imports made absolute, and `from p import
    x` read as p.x where p is a bare package (posttrain, torch) or a package's own folder (`from . import x`)."""
    top = module.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                target = ".".join(parts[: len(parts) + is_package - node.level] + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module and target not in (top, "torch"):
                yield node.lineno, target
            else:
                yield from ((node.lineno, f"{target}.{alias.name}") for alias in node.names)


def import_problems(package: Path, layers=LAYERS) -> list[str]:
    """Every import in `package` (the posttrain folder) that breaks the layers, as `file:line: why`."""
    level = {unit: i for i, names in enumerate(layers) for unit in names}
    problems: list[tuple[Path, int, str]] = []
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package.parent)
        mine = unit_of(module, set(level), package)
        where = path.relative_to(package.parent)
        if mine is None:
            problems.append((where, 0, "its package is in no layer; add it to LAYERS in tests/test_layers.py"))
            continue
        for line, target in imported(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            if (target == "torch.distributed" or target.startswith("torch.distributed.")) and mine != DISTRIBUTED:
                problems.append((where, line, f"imports {target}; collectives belong in posttrain.{DISTRIBUTED}"))
            if target.split(".")[0] != package.name:
                continue
            theirs = unit_of(target, set(level), package)
            if theirs == "" or theirs == mine:
                continue  # the bare package (a version string), or its own unit
            if theirs is None:
                problems.append((where, line, f"imports {target}, which is in no layer"))
            elif mine == "" or level[theirs] >= level[mine]:
                how = "its own layer" if mine and level[theirs] == level[mine] else "a layer above"
                problems.append((where, line, f"{mine or package.name} imports {target} ({theirs}: {how})"))
    return [f"{where}:{line}: {why}" if line else f"{where}: {why}" for where, line, why in sorted(problems)]


def imports_between_units(package: Path, layers=LAYERS) -> dict[str, set[str]]:
    """unit -> the other units it imports (the bare package left out)."""
    units = {unit for names in layers for unit in names}
    edges: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package.parent)
        mine = unit_of(module, units, package)
        for _, target in imported(ast.parse(path.read_text()), module, path.name == "__init__.py"):
            theirs = unit_of(target, units, package) if target.split(".")[0] == package.name else None
            if mine and theirs and theirs != mine:
                edges.setdefault(mine, set()).add(theirs)
    return edges


def architecture_section(package: Path = ROOT / "posttrain", layers=LAYERS) -> str:
    """The text between the layer markers of docs/architecture.md: the layers, top first, and what each unit imports."""
    edges = imports_between_units(package, layers)
    lines = ["```", "layer  unit             imports"]
    for number, names in reversed(list(enumerate(layers))):
        for unit in names:
            lines.append(f"{number:>5}  {unit:<16} {', '.join(sorted(edges.get(unit, ()))) or '-'}")
    return "\n".join(lines + ["```"])


BEGIN, END = "<!-- layers: begin -->", "<!-- layers: end -->"


def test_no_import_runs_upward_or_in_a_circle():
    assert import_problems(ROOT / "posttrain") == []


def test_the_architecture_page_shows_the_layers_as_they_are():
    page = (ROOT / "docs" / "architecture.md").read_text()
    shown = textwrap.dedent(page[page.index(BEGIN) + len(BEGIN): page.index(END)]).strip()
    assert shown == architecture_section(), "paste the output of `python tests/test_layers.py` into docs/architecture.md"


def test_an_upward_import_inside_a_function_is_named_with_its_file_and_line(tmp_path):
    package = tmp_path / "posttrain"
    for name in ("errors", "models", "config", "cli", "parallel"):
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "models" / "load.py").write_text("from ..errors import ConfigError\n\n\ndef f():\n"
                                                "    from ..config import Config\n")
    (package / "config" / "__init__.py").write_text("from posttrain.models import load\n")
    (package / "parallel" / "__init__.py").write_text("from . import balance\n")
    (package / "cli" / "__init__.py").write_text("import torch.distributed as dist\nfrom .. import config\n")
    (package / "cli" / "extra").mkdir()
    (package / "cli" / "extra" / "__init__.py").write_text("from ... import models\nfrom .. import parts\n")
    (package / "stray.py").write_text("")
    layers = [("errors",), ("parallel",), ("models",), ("config",), ("cli",)]
    assert import_problems(package, layers) == [
        "posttrain/cli/__init__.py:1: imports torch.distributed; collectives belong in posttrain.parallel",
        "posttrain/models/load.py:5: models imports posttrain.config (config: a layer above)",
        "posttrain/stray.py: its package is in no layer; add it to LAYERS in tests/test_layers.py",
    ]
    layers = [("errors",), ("parallel",), ("models", "config"), ("cli",)]
    assert "posttrain/config/__init__.py:1: config imports posttrain.models (models: its own layer)" in \
        import_problems(package, layers)


if __name__ == "__main__":
    sys.stdout.write(textwrap.indent(f"{BEGIN}\n{architecture_section()}\n{END}\n", "  "))  # in a list item
