"""The import arrows of the house: `moe_platform` → `moe`, `data_pipeline`, never back; no cycles inside a package;
Hydra only at the entry point. Checked on the source (every import statement, lazy ones inside functions too)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moe", "data_pipeline", "moe_platform")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module named by an import statement anywhere in the file (absolute imports only: the repo uses them)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


GRAPH = {module_name(p): imports_of(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}


def internal_edges(module: str) -> set[str]:
    """Project modules `module` imports, excluding its own package's __init__ (importing a sibling runs it)."""
    return {m for m in GRAPH[module] if m in GRAPH and m != module and m != module.split(".")[0]}


def find_cycle(start: str) -> list[str] | None:
    stack = [(start, [start])]
    seen = set()
    while stack:
        node, path = stack.pop()
        for nxt in internal_edges(node):
            if nxt == start:
                return [*path, nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_imports_itself_through_a_cycle(module: str) -> None:
    assert find_cycle(module) is None, " → ".join(find_cycle(module))


@pytest.mark.parametrize("package", ["moe", "data_pipeline"])
def test_libraries_never_import_the_runtime_or_hydra(package: str) -> None:
    for module, imported in GRAPH.items():
        if module.split(".")[0] == package:
            bad = {m for m in imported if m.split(".")[0] in ("moe_platform", "hydra")}
            assert not bad, f"{module} imports {sorted(bad)}"


ENTRY_POINTS = {"moe_platform.cli", "moe_platform.submit"}  # the commands that compose configs with Hydra


def test_only_the_entry_points_import_hydra_or_the_cli() -> None:
    for module, imported in GRAPH.items():
        if module.startswith("moe_platform") and module not in ENTRY_POINTS:
            bad = {m for m in imported if m.split(".")[0] == "hydra" or m.startswith("moe_platform.cli")}
            assert not bad, f"{module} imports {sorted(bad)}"
