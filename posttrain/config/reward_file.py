"""Check a `custom_reward_function.path` file before anything loads, without running it.

The file is parsed, not imported: a syntax error, a missing function, a signature that cannot take the four
arguments the reward manager passes, or a top-level import of a package that is not installed is reported at
config time instead of after the models have loaded (or as a score of 0 on every response).
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

# the reward manager calls compute_score(data_source, solution_str, ground_truth, extra_info)
CALL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def reward_file_problem(path: str, name: str) -> str | None:
    """What is wrong with `path` as the source of function `name`, or None when nothing visible is."""
    file = Path(path).expanduser()
    key = "custom_reward_function.path"
    if not file.is_file():
        return f"{key}: '{path}' does not exist (or is not a file)"
    raw = file.read_bytes()
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        return f"{key}: {file} is not UTF-8 text (byte {e.start}, line {line})"
    try:
        tree = ast.parse(source, filename=str(file))
    except SyntaxError as e:
        where = f"line {e.lineno}" + (f", column {e.offset}" if e.offset else "")
        text = f": {e.text.strip()}" if e.text and e.text.strip() else ""
        return f"{key}: {file} has a syntax error at {where} ({e.msg}){text}"
    missing = [m for m in _missing_imports(tree)  # a module beside the file may be put on sys.path by the file
               if not ((file.parent / f"{m}.py").is_file() or (file.parent / m).is_dir())]
    if missing:
        return (f"{key}: {file} imports {', '.join(repr(m) for m in missing)}, which is not installed "
                f"(pip install it, or remove the import)")
    defined = _top_level(tree)
    node = defined.get(name)
    if node is None:
        functions = sorted(n for n, d in defined.items() if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)))
        return (f"custom_reward_function.name: {file} defines no function {name!r} (functions defined there: "
                f"{functions}); set custom_reward_function.name to one of them")
    if isinstance(node, ast.ClassDef):
        return None  # a callable class: its __call__ is checked when it is loaded
    if isinstance(node, ast.AsyncFunctionDef):
        return f"custom_reward_function.name: {file}:{name} is an async function; the reward manager calls a plain one"
    if isinstance(node, ast.FunctionDef):
        return _signature_problem(node, f"{file}:{node.lineno} {name}")
    return None  # assigned (name = ...) or imported: checked when it is loaded


def _signature_problem(fn: ast.FunctionDef, where: str) -> str | None:
    """Whether fn(data_source, solution_str, ground_truth, extra_info) binds: four positional arguments fit, and
    no other argument is required."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    required_kw = [k.arg for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    required = len(positional) - len(a.defaults)
    fits = (a.vararg is not None or len(positional) >= len(CALL_ARGS)) and required <= len(CALL_ARGS)
    if fits and not required_kw:
        return None
    expected = ", ".join(CALL_ARGS)
    return (f"custom_reward_function.name: {where}({ast.unparse(a)}) cannot be called as "
            f"compute_score({expected}); give it these four parameters (extra_info may default to None)")


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Names bound at the module's top level (the last binding wins, as when the module runs)."""
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    names[t.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # conditional definitions: taken as defined
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.setdefault(sub.name, sub)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.setdefault(sub.id, sub)
    return names


def _missing_imports(tree: ast.Module) -> list[str]:
    """Top-level packages imported unconditionally (outside try/if) that cannot be found on sys.path."""
    from ..data.verl_compat import supplied

    wanted = []  # (a module posttrain answers where verl is not installed is there: data/verl_compat.py)
    for node in tree.body:
        if isinstance(node, ast.Import):
            wanted += [alias.name.split(".")[0] for alias in node.names if not supplied(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and not supplied(node.module):
            wanted.append(node.module.split(".")[0])
    missing = []
    for name in dict.fromkeys(wanted):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing
