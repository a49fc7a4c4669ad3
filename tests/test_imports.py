"""The package's modules import each other one way: no import cycles, lazy imports included.

The graph is built from the source with ``ast`` (nothing is imported), so a
cycle hidden inside a function (``def main(): from .b import x`` in ``a``
while ``b`` imports ``a``) counts too: it is a cycle in the design even when
Python tolerates it at run time.
"""

from __future__ import annotations

import ast
import os
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "adaptive_amp"
#: Compiled modules (no .py source; leaves of the graph).
EXTENSIONS = ("adaptive_amp._C",)


def modules(root: str, package: str) -> dict:
    """Dotted module name -> (path, is_package) for every .py file of the package."""
    found = {}
    base = os.path.join(root, package)
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d != "__pycache__" and os.path.isfile(os.path.join(folder, d, "__init__.py"))]
        rel = os.path.relpath(folder, root).replace(os.sep, ".")
        for name in files:
            if not name.endswith(".py"):
                continue
            stem = name[:-3]
            dotted = rel if stem == "__init__" else f"{rel}.{stem}"
            found[dotted] = (os.path.join(folder, name), stem == "__init__")
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a relative import's base."""
    if level == 0:
        return target or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def import_graph(root: str = ROOT, package: str = PACKAGE, extensions=EXTENSIONS) -> dict:
    """Module -> set of package modules it imports (at module level or inside functions).

    ``from X import name`` is an edge to ``X.name`` when that is a module,
    else to ``X``. Importing ``a.b.c`` also runs ``a`` and ``a.b``, but those
    implicit parent imports are left out: every module would otherwise form a
    cycle with the ``__init__`` that imports it.
    """
    mods = modules(root, package)
    mods.update({ext: (None, False) for ext in extensions})
    graph = {name: set() for name in mods}
    for name, (path, is_pkg) in mods.items():
        if path is None:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_pkg, node.level, node.module)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                # `import adaptive_amp.x.y` names the deepest module that exists.
                while target and target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict) -> list:
    """Every strongly connected component with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(graph, component) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in members]
    return "{" + ", ".join(component) + "}: " + "; ".join(edges)


def test_package_has_no_import_cycles():
    graph = import_graph()
    assert f"{PACKAGE}.ops" in graph and f"{PACKAGE}.__main__" in graph, sorted(graph)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (break each by moving the shared code to a module both can import):\n" + \
        "\n".join(_describe(graph, c) for c in cycles)


def test_the_checker_finds_lazy_and_relative_cycles(tmp_path):
    """The checker itself: a cycle through a function-level import and through a subpackage is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from .a import f\n",
        "a.py": "def f():\n    from .b import g\n    return g\n",
        "b.py": "from . import a\ng = 1\n",
        "c.py": "import pkg.sub.d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from .. import c\n",
        "sub/e.py": "from ..a import f\nfrom . import d\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(textwrap.dedent(text))
    graph = import_graph(str(tmp_path), "pkg", extensions=())
    assert graph["pkg.sub.e"] == {"pkg.a", "pkg.sub.d"}
    assert graph["pkg"] == {"pkg.a"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.sub.d"]]
