"""The packages' import graph has no cycle (DESIGN.md: dependencies point one way; a kernel file
never imports the module that dispatches to it).

The graph is read from the source with `ast`, not by importing: every `import` statement counts,
at module level or inside a function (a lazy import that closes a circle is still a circle; it only
moves the failure from import time to the first call). Not counted:
- a package's `__init__` that Python runs before a submodule (`import a.b.c` runs `a` and `a.b`
  first): a package importing its own submodules is how packages are built, and counting the
  implicit edge back would make every such package a "cycle";
- imports under `if TYPE_CHECKING:` (never run; there are none today);
- names built at run time (`importlib.import_module(f"data_packing.{name}")` in
  data_packing/__init__.py): not statically known, and they only go from the package to its
  submodules.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("elephant", "data_packing")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages ('a.b' for a/b/__init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the statements inside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that module `name` (file `path`) imports anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: from the package (a module's parent, or an __init__ itself)
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            out.update(f"{target}.{alias.name}" for alias in node.names
                       if f"{target}.{alias.name}" in modules)
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if color[root] != WHITE:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        color[root] = GREY
        while stack:
            node, children = stack[-1]
            for child in children:
                if color[child] == GREY:
                    path = [n for n, _ in stack]
                    return path[path.index(child):] + [child]
                if color[child] == WHITE:
                    color[child] = GREY
                    stack.append((child, iter(sorted(graph[child]))))
                    break
            else:
                color[node] = BLACK
                stack.pop()
    return None


def test_graph_is_read_from_every_module():
    graph = import_graph()
    assert {"elephant.model", "elephant.layers.ssd", "elephant.layers.ssd_triton",
            "data_packing.batcher"} <= set(graph)
    assert "elephant.layers.ssd_triton" in graph["elephant.layers.ssd"]   # the dispatch edge
    assert "elephant.model" in graph["elephant.trainer"]


def test_find_cycle_sees_a_lazy_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_lazy_imports_count(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from pkg import other\n    import pkg.third\n")
    assert imports_of("pkg.m", src, {"pkg", "pkg.m", "pkg.other", "pkg.third"}) == {
        "pkg", "pkg.other", "pkg.third"}


def test_packages_import_graph_is_acyclic():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_data_packing_never_imports_elephant():
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.split(".")[0] == "elephant")
           for m, ts in graph.items() if m.startswith("data_packing")}
    assert not any(bad.values()), bad
