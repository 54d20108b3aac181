"""The repository's shape, measured from the code's imports: no import cycle in the package, the
package root holds only the vocabulary both processes import, no module grows past what a reader
takes in at once, and scripts never import the tests."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lmcache_mp"
# What the daemon and the connector both import: the wire, the chunk vocabulary, settings, sockets.
ROOT_MODULES = {"__init__", "protocol", "chunks", "custom_types", "errors", "settings", "config", "sockets",
                "curve"}
MAX_LINES = 550


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}


def imported(path: Path, known: set[str]) -> set[str]:
    """The package modules `path` imports, at run time or for type checking alike."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    modules = package_modules()
    # A package's __init__ is imported on the way to its modules: that edge is not a dependency.
    graph = {name: {dep for dep in imported(path, set(modules)) if not name.startswith(dep + ".")}
             for name, path in modules.items()}
    assert cycle(graph) is None, f"import cycle: {' -> '.join(cycle(graph) or [])}"


def test_the_package_root_holds_only_the_shared_vocabulary() -> None:
    loose = {path.stem for path in PACKAGE.glob("*.py")} - ROOT_MODULES
    assert not loose, f"modules at the root of lmcache_mp/ that belong in a folder: {sorted(loose)}"


def test_no_module_is_longer_than_a_reader_takes_in_at_once() -> None:
    long = {name: lines for name, path in package_modules().items()
            if (lines := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these: {long}"


def test_scripts_never_import_the_tests() -> None:
    offenders = []
    for path in (REPO / "scripts").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}: {name}" for name in names
                          if name == "tests" or name.startswith("tests.")]
    assert not offenders, offenders
