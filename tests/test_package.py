"""The package's shape: its modules import each other in one direction only.

An import cycle hidden behind an import inside a function still ties two
modules together (neither can be read, tested or loaded without the other),
so the walk reads every import statement of every module, wherever it sits.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxflash"
MAX_LINES = 550


def package_modules(root: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
  """Every module of the package in folder `root`, by dotted name."""
  modules = {}
  for path in sorted(root.rglob("*.py")):
    parts = path.relative_to(root.parent).with_suffix("").parts
    modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return modules


def import_graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
  return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def top_level_names(path: pathlib.Path) -> set[str]:
  """The names a module's own top level binds (imports, assignments, defs)."""
  names = set()
  for node in ast.parse(path.read_text(), str(path)).body:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
  return names


def imported_modules(here: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """The package's modules that module `here` (file `path`) imports, at any depth
  of its syntax tree: inside functions and branches too.

  `from a import b` names module a.b when a.b is a module of the package, the
  module a when a's top level binds b, and nothing else (b is then a compiled
  extension, which imports nothing of the package).
  """
  package = here if path.name == "__init__.py" else here.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      for alias in node.names:
        if f"{base}.{alias.name}" in modules:
          found.add(f"{base}.{alias.name}")
        elif base in modules and (alias.name == "*" or alias.name in top_level_names(modules[base])):
          found.add(base)
  return {m for m in found if m in modules and m != here}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle of `graph` as [a, b, ..., a], or None (depth-first search)."""
  state: dict[str, int] = {}   # 1: on the current path, 2: finished
  path: list[str] = []

  def visit(node: str) -> list[str] | None:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt)):
        return cycle
    path.pop()
    state[node] = 2
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node)):
      return cycle
  return None


def test_the_walk_sees_imports_inside_functions(tmp_path):
  """The walk itself: a cycle made only of imports inside functions is found."""
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("def f():\n  from pkg import b\n  return b\n")
  (pkg / "b.py").write_text("def g():\n  if True:\n    from .a import f\n")
  graph = import_graph(package_modules(pkg))
  assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
  assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
  (pkg / "b.py").write_text("import os\n")
  assert find_cycle(import_graph(package_modules(pkg))) is None


def test_the_package_has_no_import_cycle():
  modules = package_modules()
  assert "jaxflash._core" in modules and "jaxflash.pallas" in modules
  graph = import_graph(modules)
  assert "jaxflash._core" in graph["jaxflash.ring"]   # the walk finds the package's imports
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_fits_in_a_reader_head():
  long = {name: n for name, path in package_modules().items()
          if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"
