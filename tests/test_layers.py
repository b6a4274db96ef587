"""The layer rule of docs/DESIGN.md section 1, checked on the code's own imports: every import of every
module in the package (module level, inside functions and under TYPE_CHECKING alike, relative ones
resolved) goes to its own layer or below, and no modules import each other in a circle.

The layers are read from the table in docs/DESIGN.md section 1, so the table and the code cannot drift
apart: a module the table does not place fails here too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokenrouter"


def layer_table() -> dict[str, int]:
    """{path prefix under the repository ('tokenrouter/engine/', 'tokenrouter/cli.py'): layer}."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("## 1 Layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for line in section.splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|(.*?)\|", line)
        if row:
            for path in re.findall(r"`(tokenrouter/[^`]*)`", row.group(2)):
                table[path] = int(row.group(1))
    assert table, "docs/DESIGN.md section 1 has no layer table"
    return table


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(path: Path, table: dict[str, int]) -> int:
    rel = path.relative_to(ROOT).as_posix()
    matches = [prefix for prefix in table if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix))]
    assert matches, f"{rel} is in no layer of docs/DESIGN.md section 1: add it to the table"
    return table[max(matches, key=len)]


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, the module mod.
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def upward_imports(graph: dict[str, set[str]], table: dict[str, int]) -> list[str]:
    known = modules()
    layer = {name: layer_of(path, table) for name, path in known.items()}
    return sorted(f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]})"
                  for a, targets in graph.items() for b in targets if layer[b] > layer[a])


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    table = layer_table()
    for path in modules().values():
        layer_of(path, table)


def test_no_import_goes_up_a_layer():
    assert upward_imports(import_graph(), layer_table()) == []


def test_no_modules_import_each_other_in_a_circle():
    assert cycles(import_graph()) == []


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a function-level import and a relative one are both found."""
    source = "def f():\n    from tokenrouter.training import default_model\n\nfrom . import engine\n"
    path = PACKAGE / "engine" / "layer_probe.py"
    known = {**modules(), "tokenrouter.engine.layer_probe": path}
    tree_path = tmp_path / "layer_probe.py"
    tree_path.write_text(source)
    found = imports_of("tokenrouter.engine.layer_probe", tree_path, known)
    assert found == {"tokenrouter.training.default_model", "tokenrouter.engine.engine"}


def test_the_offline_api_takes_its_default_model_from_the_registry():
    """LLM() with no model asks the resolver a layer above registered (the package's face registers the
    embedded default), instead of importing the training layer itself."""
    import tokenrouter
    from tokenrouter.llm import LLM, register_default_model

    asked = []
    register_default_model(lambda: asked.append(1) or str(ROOT / "no-such-model"))
    try:
        try:
            LLM()
        except Exception as e:  # noqa: BLE001 - whatever the loader raises, it must name the registered path
            assert "no-such-model" in str(e)
        else:
            raise AssertionError("LLM() loaded a model that does not exist")
    finally:
        register_default_model(tokenrouter.embedded_default_model)
    assert asked == [1]
