"""The package's dependency rules, read from the source: what each folder may import, no cycles, and
which parts never load torch.

docs/architecture.md states the same rules in words; this test is what keeps them. Imports are read
with `ast` from every module (at module level and inside functions alike), so a rule cannot be
dodged by importing late.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "isthmus"

# What each part of the package may import from isthmus (besides itself). Leaves first.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "log": set(),
    "layout": {"errors"},
    "config": {"errors", "layout"},
    "models": {"errors", "config"},
    "data": {"errors", "log", "config"},
    "planner": {"errors", "log", "config", "layout", "models"},
    "sim": {"errors", "log", "config", "layout", "models", "planner"},
    "parallel": {"errors", "log", "config", "layout", "models"},
    "geo": {"errors", "log", "config", "layout", "models", "parallel"},
    "checkpoint": {"errors", "log", "config", "layout", "models", "data"},
    "weights": {"errors", "log", "config", "layout", "models", "data", "checkpoint"},
    "serve": {"errors", "log", "config", "layout", "models", "data", "parallel", "weights"},
    # profile: only its device module (the peak FLOP/s that MFU divides by) is the trainer's.
    "train": {
        "errors",
        "log",
        "config",
        "layout",
        "models",
        "data",
        "parallel",
        "geo",
        "checkpoint",
        "weights",
        "serve",
        "profile",
    },
    "api": {"errors", "log", "config", "layout", "models", "parallel", "train", "profile"},
    # launch: the measurements' two ranks fork from the launcher's rank server, and end as its ranks do.
    "profile": {"errors", "log", "config", "layout", "models", "parallel", "train", "api", "planner", "launch"},
    "launch": {
        "errors",
        "log",
        "config",
        "layout",
        "models",
        "data",
        "parallel",
        "geo",
        "checkpoint",
        "serve",
        "train",
        "planner",
        "profile",
    },
    "cli": {
        "errors",
        "log",
        "config",
        "layout",
        "models",
        "data",
        "parallel",
        "geo",
        "checkpoint",
        "weights",
        "serve",
        "train",
        "planner",
        "sim",
        "profile",
        "launch",
        "api",
    },
}
# Parts a user runs without a GPU stack or for planning only: importing them must not load torch.
TORCH_FREE = [
    "isthmus.errors",
    "isthmus.log",
    "isthmus.config",
    "isthmus.planner",
    "isthmus.sim",
    "isthmus.planner.autoplan",
    "isthmus.planner.topology",
    "isthmus.cli",
    "isthmus.launch.preflight",
]


def _part(module: str) -> str:
    """``isthmus.planner.cost`` -> ``planner``; the package's own ``__init__``/``__main__`` -> ``root``."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__init__", "__main__"):
        return "root"
    return parts[1]


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent).with_suffix("")
        name = ".".join(rel.parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(module: str, path: Path) -> set[str]:
    """Every isthmus module this one imports, anywhere in it (relative imports resolved)."""
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "isthmus")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.split(".")[0] != "isthmus":
                continue
            out.add(base)
            # `from isthmus.cli import plan` imports the module isthmus.cli.plan
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in _MODULES)
    return {m for m in out if m in _MODULES or any(k.startswith(m + ".") for k in _MODULES)}


_MODULES = _modules()


def test_every_part_imports_only_what_it_may() -> None:
    broken = []
    for module, path in _MODULES.items():
        part = _part(module)
        if part == "root":
            continue
        assert part in ALLOWED, (
            f"{module}: the part {part!r} has no rule in this test (and none in docs/architecture.md)"
        )
        for target in sorted(_imports(module, path)):
            other = _part(target)
            if other not in (part, "root") and other not in ALLOWED[part]:
                broken.append(
                    f"{module} imports {target} ({part} may import: {', '.join(sorted(ALLOWED[part])) or 'nothing'})"
                )
            if other == "root" and target == "isthmus" and part != "cli":
                broken.append(
                    f"{module} imports the package root `isthmus` (its public API), which imports the runtime"
                )
    assert not broken, "\n".join(broken)


def test_no_import_cycles_between_modules() -> None:
    graph = {m: _imports(m, p) - {m} for m, p in _MODULES.items()}
    # A package's __init__ importing its own modules is not a cycle of the design: leave those edges out.
    graph = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}
    seen: dict[str, int] = {}  # 1 on the stack, 2 done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        for t in sorted(graph.get(m, ())):
            if seen.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]) if t in stack else f"{m} -> {t}")
            elif t not in seen:
                visit(t, stack + [t])
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_planning_and_the_command_line_do_not_load_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False", f"importing {module} loads torch"
