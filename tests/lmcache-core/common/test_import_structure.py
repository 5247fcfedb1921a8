"""Import structure of lmcache-core: no cycles, no private names across modules, layers down.

The checks read ``packages/lmcache-core/src/lmcache`` with :mod:`ast` (nothing is imported)
and build a graph of its modules. The rules, kept simple on purpose:

- **Every import counts**: module level, inside functions and methods, under ``if``/``try``,
  and ``importlib.import_module("lmcache....")`` with a literal name. Module names held in
  data (the L2 registry's ``BUILTIN_MODULES``, PEP 562 lazy-name tables, the CLI's
  subcommand table) are not edges: they are loaded the way plugins are, through a table.
  Only imports under ``if TYPE_CHECKING:`` are left out: they never run, so they cannot
  form a cycle at run time. A lazy import in a function body is allowed for start-up cost
  (torch, plugins), but it is an edge like any other, so it cannot hide a cycle.
- **Edges**: ``import a.b`` and ``from a.b import name`` give an edge to ``a.b``;
  ``from a import b`` gives an edge to the submodule ``a.b`` when ``a.b`` is a module of
  ours, else to ``a`` (the package's ``__init__``). Relative imports are resolved first.
  The implicit import of parent packages (``import a.b`` runs ``a/__init__``) is not an
  edge: a package importing its own submodules is therefore no cycle by itself, but a
  submodule that imports a name from its package's ``__init__`` is an edge back, and the
  pair is then a cycle.
- **Cycles**: any strongly connected component of more than one module fails, with one
  concrete cycle printed.
- **Private names**: ``from lmcache.x import _name`` (``_name`` not a submodule, not a
  dunder) fails anywhere in core; a private name is its module's business. Attribute use
  such as ``mod._name`` is out of scope.
- **Layers** (docs/design/architecture.md): platform < distributed < multiprocess <
  cli/integration; a module may import only its own layer or those below. Modules outside
  ``lmcache.v1.{platform,distributed,multiprocess}``, ``lmcache.cli`` and
  ``lmcache.integration`` (``lmcache.utils``, ``lmcache.v1.errors``, ...) are shared
  helpers: they may be imported by every layer, and may import only each other and the
  platform layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CORE_SRC = ROOT / "packages" / "lmcache-core" / "src"
PACKAGE = "lmcache"

# Lower number = lower layer. ``None`` marks a shared helper (see the module docstring).
LAYERS: list[tuple[str, int]] = [
    ("lmcache.v1.platform", 0),
    ("lmcache.v1.distributed", 1),
    ("lmcache.v1.multiprocess", 2),
    ("lmcache.cli", 3),
    ("lmcache.integration", 3),
]
LAYER_NAMES = {0: "platform", 1: "distributed", 2: "multiprocess", 3: "cli/integration"}
# Shared helpers may import these layers (and each other) only.
HELPER_MAY_IMPORT = {0}

# (importer, imported) pairs that break the layer rule on purpose, each with its reason.
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement's reference from module ``source`` (at ``line``)."""

    source: str
    line: int
    target: str  # the module the edge points to
    names: tuple[str, ...]  # names taken with ``from target import ...`` (non-modules)


def module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


_IMPORTING_CALLS = {"import_module", "__import__"}


def _literal_import(node: ast.AST) -> str | None:
    """The module named by ``import_module("x")`` / ``__import__("x")``, else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    first = node.args[0]
    if name in _IMPORTING_CALLS and isinstance(first, ast.Constant):
        return first.value if isinstance(first.value, str) else None
    return None


def _import_nodes(
    tree: ast.AST, type_checking: bool = False
) -> Iterable[ast.Import | ast.ImportFrom | ast.Call]:
    """Every import node (and importing call) in ``tree``; those under
    ``if TYPE_CHECKING:`` only if asked."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.Call) and _literal_import(node) is not None:
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            stack.extend(node.orelse)  # ``else:`` of TYPE_CHECKING runs
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def collect_imports(
    src: Path, package: str = PACKAGE, type_checking: bool = False
) -> tuple[set[str], list[Import]]:
    """All modules under ``src/package`` and every import among them (see the rules above);
    ``type_checking=True`` adds the imports under ``if TYPE_CHECKING:``."""
    files = {module_name(p, src): p for p in sorted((src / package).rglob("*.py"))}
    modules = set(files)
    found: list[Import] = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _import_nodes(tree, type_checking):
            if isinstance(node, ast.Call):
                literal = _literal_import(node)
                if literal in modules:
                    found.append(Import(name, node.lineno, literal, ()))
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        found.append(Import(name, node.lineno, alias.name, ()))
                continue
            base = _resolve(node, name, path.name == "__init__.py")
            plain: list[str] = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.append(Import(name, node.lineno, sub, ()))
                else:
                    plain.append(alias.name)
            if plain and base in modules:
                found.append(Import(name, node.lineno, base, tuple(plain)))
    return modules, found


def import_graph(imports: Iterable[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.target != imp.source:
            graph.setdefault(imp.source, set()).add(imp.target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components of more than one node, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    result: list[list[str]] = []
    counter = 0
    nodes = sorted(set(graph) | {t for ts in graph.values() for t in ts})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    result.append(sorted(comp))
    return sorted(result)


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete cycle through the component's first module (breadth-first, shortest)."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ()) & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    nxt.append(child)
        frontier = nxt
    return component


def find_cycles(src: Path, package: str = PACKAGE) -> list[str]:
    """One line per import cycle: ``a -> b (line 12) -> a (line 3)``."""
    _, imports = collect_imports(src, package)
    graph = import_graph(imports)
    where = {}
    for imp in imports:
        where.setdefault((imp.source, imp.target), imp.line)
    out = []
    for comp in strongly_connected(graph):
        cycle = one_cycle(graph, comp)
        hops = [cycle[0]] + [
            f"{b} (line {where[(a, b)]} of {a})" for a, b in zip(cycle, cycle[1:], strict=False)
        ]
        out.append(" -> ".join(hops) + f"   [component: {', '.join(comp)}]")
    return out


def find_private_imports(src: Path, package: str = PACKAGE) -> list[str]:
    """Every ``from <ours> import _name`` (a private name, not a submodule, not a dunder),
    ``if TYPE_CHECKING:`` imports included: a private name is private to type hints too."""
    _, imports = collect_imports(src, package, type_checking=True)
    return sorted(
        f"{imp.source} (line {imp.line}) imports {imp.target}.{n}"
        for imp in imports
        for n in imp.names
        if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))
    )


def layer_of(module: str) -> int | None:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def find_layer_violations(src: Path, package: str = PACKAGE) -> list[str]:
    """Every import pointing up a layer (see the module docstring), minus LAYER_EXCEPTIONS."""
    _, imports = collect_imports(src, package)
    out = []
    for imp in imports:
        if (imp.source, imp.target) in LAYER_EXCEPTIONS:
            continue
        mine, theirs = layer_of(imp.source), layer_of(imp.target)
        if theirs is None:
            continue  # helpers may be imported by anyone
        if mine is None:
            bad = theirs not in HELPER_MAY_IMPORT
            label = "a shared helper"
        else:
            bad = theirs > mine
            label = LAYER_NAMES[mine]
        if bad:
            out.append(
                f"{imp.source} (line {imp.line}, {label}) imports {imp.target} "
                f"({LAYER_NAMES[theirs]})"
            )
    return sorted(set(out))


# ---- lmcache-core ---------------------------------------------------------------------------


def test_the_graph_sees_core():
    modules, imports = collect_imports(CORE_SRC)
    assert "lmcache.v1.platform.base.device_ops" in modules
    assert "lmcache.v1.distributed.l2_adapters.config" in modules
    assert len(imports) > 300


def test_core_has_no_import_cycle():
    cycles = find_cycles(CORE_SRC)
    assert not cycles, (
        "import cycles in lmcache-core (a lazy import does not excuse one; move the shared "
        "piece down a layer or into its own module):\n" + "\n".join(cycles)
    )


def test_core_imports_no_private_name_across_modules():
    found = find_private_imports(CORE_SRC)
    assert not found, (
        "private names imported across modules (move the shared piece, or make it public "
        "with a real name and docstring):\n" + "\n".join(found)
    )


def test_core_imports_point_down_the_layers():
    found = find_layer_violations(CORE_SRC)
    assert not found, "imports pointing up a layer:\n" + "\n".join(found)


def test_layer_exceptions_are_still_needed():
    _, imports = collect_imports(CORE_SRC)
    edges = {(i.source, i.target) for i in imports}
    stale = [pair for pair in LAYER_EXCEPTIONS if pair not in edges]
    assert not stale, f"LAYER_EXCEPTIONS lists imports that no longer exist: {stale}"


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_one_copy_module_below_the_engine_and_the_worker_contexts():
    """The paged KV copies live in one module both sides share: the server's engine and the
    worker transfer contexts reach it, and it reaches neither of them."""
    _, imports = collect_imports(CORE_SRC)
    graph = import_graph(imports)
    copy_module = "lmcache.v1.multiprocess.kv_copy"
    sides = ("lmcache.v1.multiprocess.engine", "lmcache.v1.multiprocess.transfer_context")
    above = sorted(m for m in reachable(graph, copy_module) if m.startswith(sides))
    assert not above, f"{copy_module} imports the code that uses it: {above}"
    for user in (
        "lmcache.v1.multiprocess.engine.write_path",
        "lmcache.v1.multiprocess.engine.read_path",
        "lmcache.v1.multiprocess.transfer_context.worker_transfer",
    ):
        assert copy_module in reachable(graph, user), f"{user} does not use {copy_module}"


# ---- the checkers catch what they must -------------------------------------------------------


def _write(src: Path, files: dict[str, str]) -> Path:
    for rel, body in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    return src


def test_cycle_checker_sees_function_level_and_relative_imports(tmp_path):
    src = _write(
        tmp_path,
        {
            "lmcache/__init__.py": "",
            "lmcache/v1/__init__.py": "",
            "lmcache/v1/platform/__init__.py": "",
            "lmcache/v1/platform/a.py": "from .b import thing\n",
            "lmcache/v1/platform/b.py": (
                "def f():\n    if True:\n        from lmcache.v1.platform import c\n"
            ),
            "lmcache/v1/platform/c.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from . import d\n"  # excluded
                "def g():\n    import lmcache.v1.platform.a\n"
            ),
            "lmcache/v1/platform/d.py": "from . import c\n",
            "lmcache/v1/platform/e.py": (
                "import importlib\n"
                "def h():\n    return importlib.import_module('lmcache.v1.platform.f')\n"
            ),
            "lmcache/v1/platform/f.py": "from lmcache.v1.platform import e\n",
        },
    )
    cycles = find_cycles(src)
    assert len(cycles) == 2, cycles
    assert cycles[1].startswith(
        "lmcache.v1.platform.e -> lmcache.v1.platform.f (line 3 of lmcache.v1.platform.e)"
    ), cycles
    assert cycles[0].startswith(
        "lmcache.v1.platform.a -> lmcache.v1.platform.b (line 1 of lmcache.v1.platform.a)"
        " -> lmcache.v1.platform.c (line 3 of lmcache.v1.platform.b)"
        " -> lmcache.v1.platform.a (line 5 of lmcache.v1.platform.c)"
    ), cycles


def test_cycle_checker_package_init_rule(tmp_path):
    files = {
        "lmcache/__init__.py": "",
        "lmcache/pkg/__init__.py": "from .sub import X\n",  # re-export: package -> sub
        "lmcache/pkg/sub.py": "X = 1\n",
    }
    assert find_cycles(_write(tmp_path / "ok", files)) == []
    files["lmcache/pkg/sub.py"] = "from lmcache.pkg import Y\nX = 1\n"  # sub -> package
    cycles = find_cycles(_write(tmp_path / "bad", files))
    assert len(cycles) == 1 and "lmcache.pkg.sub" in cycles[0], cycles


def test_private_checker(tmp_path):
    src = _write(
        tmp_path,
        {
            "lmcache/__init__.py": "",
            "lmcache/m.py": "_hidden = 1\n",
            "lmcache/sub/__init__.py": "",
            "lmcache/sub/_impl.py": "",
            "lmcache/user.py": (
                "from lmcache.m import _hidden, __doc__\n"
                "from lmcache.sub import _impl\n"  # a private *module* is fine
                "def f():\n    from .m import _hidden as h\n"
            ),
        },
    )
    assert find_private_imports(src) == [
        "lmcache.user (line 1) imports lmcache.m._hidden",
        "lmcache.user (line 4) imports lmcache.m._hidden",
    ]


def test_layer_checker(tmp_path):
    src = _write(
        tmp_path,
        {
            "lmcache/__init__.py": "",
            "lmcache/helper.py": "from lmcache.v1.distributed import x\n",
            "lmcache/v1/__init__.py": "",
            "lmcache/v1/platform/__init__.py": "",
            "lmcache/v1/platform/p.py": "def f():\n    from lmcache.cli import main\n",
            "lmcache/v1/distributed/__init__.py": "",
            "lmcache/v1/distributed/x.py": "from lmcache.v1.platform import p\n",
            "lmcache/cli/__init__.py": "",
            "lmcache/cli/main.py": "from lmcache.v1.distributed import x\nimport lmcache.helper\n",
        },
    )
    assert find_layer_violations(src) == [
        "lmcache.helper (line 1, a shared helper) imports lmcache.v1.distributed.x (distributed)",
        "lmcache.v1.platform.p (line 2, platform) imports lmcache.cli.main (cli/integration)",
    ]
