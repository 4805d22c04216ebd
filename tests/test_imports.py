"""The package's import structure, read from the source with ``ast`` (nothing is imported).

Every ``import speedrun.x`` and ``from .x import y`` (relative imports resolved) is an edge
from the importing module to the module it names: ``y`` when that is a module, else ``x``.
Module-level imports (at the top, or in a class body) run when the module is imported;
function-level imports run when the function is called. Module-level imports form no
cycle. Function-level imports are allowed, to keep a command's start-up cost down, but not
as a way round a cycle: a module imported inside a function does not import its importer
back at module level. And the layers stay in order: report reads records and never runs or
writes them (no bench, engine.loop or commands), the engine and the lower layers import no
commands and no profiling tools (a training run uses neither), the profiling tools import no
commands and no report, and only ``__main__`` and the Python API (``speedrun.api``, which runs
each command through the command line's own parser and table, so that both are one path) import
the command line; nothing below the commands imports the API."""
import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "speedrun"

COMMANDS = ("speedrun.cli", "speedrun.training", "speedrun.bench", "speedrun.use", "speedrun.cluster")
TOOLS = ("speedrun.profiling",)       # measure a step; commands and benchmarks use them, a run never
COMMANDS_AND_TOOLS = (*COMMANDS, *TOOLS)
FORBIDDEN = {
    "speedrun.report": (*COMMANDS_AND_TOOLS, "speedrun.engine.loop"),
    "speedrun.engine": (*COMMANDS_AND_TOOLS, "speedrun.report"),
    "speedrun.data": (*COMMANDS_AND_TOOLS, "speedrun.engine", "speedrun.report"),
    "speedrun.models": (*COMMANDS_AND_TOOLS, "speedrun.engine", "speedrun.report", "speedrun.data"),
    "speedrun.optim": (*COMMANDS_AND_TOOLS, "speedrun.engine", "speedrun.report", "speedrun.data"),
    "speedrun.recipe": (*COMMANDS_AND_TOOLS, "speedrun.engine", "speedrun.report", "speedrun.data"),
    "speedrun.profiling": (*COMMANDS, "speedrun.report"),
    "speedrun.bench": ("speedrun.cli", "speedrun.training", "speedrun.use", "speedrun.cluster"),
    "speedrun.cluster": ("speedrun.cli", "speedrun.training", "speedrun.use", "speedrun.bench", *TOOLS),
    "speedrun.use": ("speedrun.cli", "speedrun.training", "speedrun.bench", "speedrun.cluster", *TOOLS),
    "speedrun.training": ("speedrun.cli", "speedrun.bench", "speedrun.use", "speedrun.cluster", *TOOLS),
}
"""Package (or module) -> what nothing in it imports, at module or function level."""

Edge = tuple[str, str, bool]          # (importer, imported, at module level)


def modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports(tree: ast.AST, module_level: bool = True) -> Iterator[tuple[ast.stmt, bool]]:
    """Every import statement under ``tree``, with whether it runs at import time."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, module_level
        inside = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from imports(node, module_level and not inside)


def targets(node: ast.stmt, name: str, is_package: bool, known: dict) -> list[str]:
    """The package's modules that ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if within(a.name, "speedrun")]
    base = node.module or ""
    if node.level:
        parts = name.split(".")[:None if is_package else -1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    if not within(base, "speedrun"):
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]


def edges() -> list[Edge]:
    known = modules()
    found = set()
    for name, (path, is_package) in known.items():
        for node, module_level in imports(ast.parse(path.read_text(), str(path))):
            found |= {(name, t, module_level) for t in targets(node, name, is_package, known) if t != name}
    return sorted(found)


def module_graph(all_edges: list[Edge]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for a, b, module_level in all_edges:
        if module_level:
            graph.setdefault(a, set()).add(b)
    return graph


def path_between(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A chain of imports start -> ... -> goal in ``graph``, or None."""
    came_from, todo = {start: None}, [start]
    while todo:
        node = todo.pop()
        if node == goal:
            chain = [node]
            while came_from[chain[-1]] is not None:
                chain.append(came_from[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph.get(node, ())):
            if nxt not in came_from:
                came_from[nxt] = node
                todo.append(nxt)
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that is on one: [a, b, ..., a]."""
    found = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            back = path_between(graph, b, a)
            if back and not any(a in c for c in found):
                found.append([a, *back])
    return found


def test_the_graph_sees_the_package():
    all_edges = edges()
    assert ("speedrun.__main__", "speedrun.cli", True) in all_edges
    assert ("speedrun.engine.loop", "speedrun.engine.checkpoint", True) in all_edges
    assert ("speedrun.cli", "speedrun.training", False) in all_edges       # a command, loaded when it runs


def test_module_level_imports_form_no_cycle():
    found = cycles(module_graph(edges()))
    assert not found, "module-level import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_function_level_import_hides_a_cycle():
    all_edges = edges()
    graph = module_graph(all_edges)
    hidden = [[a, *back] for a, b, module_level in all_edges if not module_level
              for back in [path_between(graph, b, a)] if back]
    assert not hidden, ("imports inside functions that go round a cycle (the module imported imports the "
                        "importer back at module level): " + "; ".join(" -> ".join(c) for c in hidden))


def test_the_layers_import_only_downwards():
    wrong = [f"{a} -> {b}" for a, b, _ in edges() for layer, banned in FORBIDDEN.items()
             if within(a, layer) and any(within(b, x) for x in banned)]
    assert not wrong, f"imports against the layering: {wrong}"


def test_only_main_and_the_api_import_the_command_line():
    wrong = [a for a, b, _ in edges() if b == "speedrun.cli" and a not in ("speedrun.__main__", "speedrun.api")]
    assert not wrong, f"modules importing speedrun.cli: {wrong}"
    below = [f"{a} -> {b}" for a, b, _ in edges() if b == "speedrun.api" and a not in ("speedrun", "speedrun.api",
                                                                                         "speedrun.bench")]
    assert not below, f"modules importing the Python API: {below}"
