"""The import arrows of the house: `moe_platform` → `moe`, `data_pipeline`, never back; no cycles; inside
`moe_platform`, wings (sub-packages by concern) that import each other only along the arrows in `WINGS`, a root that
imports no wing, and Hydra only in the launch wing. Checked on the source (every import statement, lazy ones inside
functions too)."""

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


# ---- the wings of moe_platform -----------------------------------------------------------------------------------
# Each wing is a sub-package named for what a user reads in the README. The arrows allowed between them point from
# the commands down to what they stand on; a wing absent from another's set may not be imported by it, lazily or not.
WINGS: dict[str, set[str]] = {
    "checkpoint": set(),  # files on disk; the trainer hands it what to save, so it needs no trainer or metrics
    "parallel": set(),  # process groups and strategies; checkpoint formats of sharded state live in checkpoint/
    "monitor": set(),  # reads records and configs; never steers training or touches checkpoints
    "interop": {"checkpoint"},  # reads our checkpoints to convert or start from them; never the trainer
    "train": {"checkpoint", "parallel", "monitor", "interop"},
    # memory and time of a layout from the ledger; builds one rank on the meta device with the real strategies
    "plan": {"parallel", "train", "monitor"},
    "launch": {"train", "checkpoint", "parallel", "monitor", "interop", "plan"},  # the commands; nothing imports them
}
# Modules at the root of moe_platform: what every wing stands on; they import no wing.
ROOT_MODULES = {"moe_platform", "moe_platform.config", "moe_platform.redact", "moe_platform.faults"}
# The tests' kit: it drives real runs (launchers, checkpoints, preemption files) and may reach into any wing but
# launch, whose commands it starts as processes.
TEST_KIT = "moe_platform.testing"


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "moe_platform" else None


RUNTIME = sorted(m for m in GRAPH if m.startswith("moe_platform"))


@pytest.mark.parametrize("module", RUNTIME)
def test_every_runtime_module_lives_in_a_wing_or_is_named_at_the_root(module: str) -> None:
    wing = wing_of(module)
    if wing is None:
        assert module in ROOT_MODULES | {TEST_KIT} or module.split(".")[-1] in WINGS, (
            f"{module} sits at the root of moe_platform: put it in a wing ({', '.join(WINGS)}) or name it in "
            "ROOT_MODULES with the reason every wing needs it"
        )
    else:
        assert wing in WINGS, f"{module} is in {wing}/, which is not a wing: add it to WINGS with its arrows"


@pytest.mark.parametrize("module", RUNTIME)
def test_imports_follow_the_arrows_between_wings(module: str) -> None:
    wing = wing_of(module)
    for imported in internal_edges(module):
        target = wing_of(imported)
        if not imported.startswith("moe_platform") or target is None or target == wing:
            continue
        if module == TEST_KIT:
            assert target != "launch", f"{module} imports {imported}: the test kit starts the commands as processes"
        elif wing is None:
            raise AssertionError(f"{module} (root) imports {imported}: the root may not depend on a wing")
        else:
            assert target in WINGS[wing], (
                f"{module} ({wing}/) imports {imported} ({target}/): allowed from {wing}/ are "
                f"{sorted(WINGS[wing]) or 'no other wing'}"
            )


def test_only_the_launch_wing_imports_hydra() -> None:
    """The commands compose configs with Hydra; below them everything takes a typed, validated TrainConfig."""
    for module, imported in GRAPH.items():
        if module.startswith("moe_platform") and wing_of(module) != "launch":
            bad = {m for m in imported if m.split(".")[0] == "hydra"}
            assert not bad, f"{module} imports {sorted(bad)}"
