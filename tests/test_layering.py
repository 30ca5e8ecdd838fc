"""The layering rule of autodist/ (docs/architecture.md), read from the code's own imports.

Every import counts: at module level, inside functions, under ``if TYPE_CHECKING``. A subsystem may import
itself and the subsystems below it in LAYERS; two subsystems on one level never import each other; no two
files import each other, directly or round a longer loop. Each subsystem's ``__init__.py`` says which
subsystems it may import, and that sentence must match the rule.
"""
from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent / "autodist"

# Top to bottom: a subsystem may import those on the levels below its own.
LAYERS: list[tuple[str, ...]] = [
    ("cli", "lightning"),  # the `autodist` command (autodist/__main__.py belongs to it); Lightning's strategy: users
    ("autodist",),  # the public face: autodist/__init__.py and api.py
    ("ps", "planner"),  # siblings: parameter servers (writing train's checkpoint file); the layout chooser
    ("train",),
    ("pp",),  # pipeline stages: the blocks dealt out, the micro-batches run through them
    ("sync", "sharded"),  # siblings: the data-parallel strategies; the optimizer state of exact sync, sharded
    ("dp", "mp", "cp", "ep"),  # siblings: none imports another (cp: context parallelism; ep: expert parallelism)
    ("layers",),
    ("faults",),
    ("runtime",),
]
LEVEL = {name: i for i, level in enumerate(LAYERS) for name in level}


def subsystem(module: str) -> str:
    """``autodist.dp.grad_sync`` -> "dp"; the package itself, api.py -> "autodist"; __main__.py -> "cli"."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "api":
        return "autodist"
    if parts[1] == "__main__":
        return "cli"
    return parts[1]


def may_import(importer: str, imported: str) -> bool:
    a, b = subsystem(importer), subsystem(imported)
    return a == b or LEVEL[a] < LEVEL[b]


def module_sources(root: pathlib.Path = ROOT) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path.read_text()
    return out


def imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the autodist modules it imports (``from pkg import mod`` is an import of pkg.mod)."""
    edges: dict[str, set[str]] = {}
    for module, text in sources.items():
        package = module if _is_package(module, sources) else module.rpartition(".")[0]
        found = edges.setdefault(module, set())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per dot after the first
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in node.names]
            else:
                continue
            found.update(t for t in targets if t in sources and t != module)
    return edges


def _is_package(module: str, sources: dict[str, str]) -> bool:
    return any(other.startswith(module + ".") for other in sources)


def violations(sources: dict[str, str]) -> list[str]:
    """Every import against the rule, and every import cycle, in words."""
    edges = imports(sources)
    out = [f"{a} imports {b}: {subsystem(a)} may not import {subsystem(b)}"
           for a in sorted(edges) for b in sorted(edges[a]) if not may_import(a, b)]
    out += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(edges)]
    return out


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(_loop(sorted(group)[0], set(group), edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _loop(start: str, group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A path from ``start`` back to itself inside ``group`` (breadth first: the shortest)."""
    paths = [[start]]
    while paths:
        path = paths.pop(0)
        for w in sorted(edges[path[-1]] & group):
            if w == start:
                return path + [start]
            if w not in path:
                paths.append(path + [w])
    return [start]


def test_autodist_keeps_the_layering_rule_and_has_no_import_cycle():
    assert violations(module_sources()) == []


def test_the_rule_catches_an_upward_import_a_sibling_import_and_a_cycle():
    tree = {
        "autodist": "",
        "autodist.runtime": "",
        "autodist.runtime.world": "from autodist.dp import grad_sync\n",  # upward
        "autodist.dp": "",
        "autodist.dp.grad_sync": "def f():\n    from autodist.mp.rewrite import plan\n",  # a sibling, lazily
        "autodist.mp": "",
        "autodist.mp.rewrite": "from autodist.mp import flow\n",
        "autodist.mp.flow": "if TYPE_CHECKING:\n    from autodist.mp.rewrite import x\n",  # a cycle, for typing only
    }
    assert violations(tree) == [
        "autodist.dp.grad_sync imports autodist.mp.rewrite: dp may not import mp",
        "autodist.runtime.world imports autodist.dp.grad_sync: runtime may not import dp",
        "import cycle: autodist.mp.flow -> autodist.mp.rewrite -> autodist.mp.flow",
    ]


def test_the_tree_is_the_diagram_few_entries_and_every_subsystem_says_what_it_may_import():
    entries = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__")
    files = [name for name in entries if name.endswith(".py")]
    assert files == ["__init__.py", "__main__.py", "api.py"], files  # 3 files, and one folder per subsystem
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LEVEL) - {"autodist"}, "a new folder needs its place in LAYERS and docs/architecture.md"
    for name in sorted(folders):
        doc = ast.get_docstring(ast.parse((ROOT / name / "__init__.py").read_text())) or ""
        assert doc.startswith(f"{name}: "), f"autodist/{name}/__init__.py must open with '{name}: what it owns'"
        said = re.search(r"May import: ([^.(]*)", doc)
        assert said is not None, f"autodist/{name}/__init__.py must say 'May import: ...'"
        allowed = {b for b in LEVEL if b != "autodist" and b != name and LEVEL[b] > LEVEL[name]}
        words = {w for w in re.split(r"[,\s]+", said.group(1)) if w}
        expected = {"everything"} if name == "cli" else allowed or {"nothing"}
        assert words - {"of", "autodist's", "and"} == expected, (name, words, expected)


def test_the_environment_is_read_in_one_place():
    """runtime/environment.py reads it for the library; the command (cli/) prepares its children's."""
    readers = sorted(module for module, text in module_sources().items()
                     if re.search(r"\bos\.(environ|getenv|putenv)\b|\bgetenv\(", _code(text))
                     and module != "autodist.runtime.environment" and subsystem(module) != "cli")
    assert readers == []


def test_nothing_received_is_unpickled():
    """Bytes from another process become objects only as data: torch.load(weights_only=True) or JSON. torch's
    *_object collectives unpickle what arrives (runtime/plain.py replaces them), as does weights_only=False."""
    unpicklers = re.compile(r"\b(all_gather_object|broadcast_object_list|gather_object|scatter_object_list|"
                            r"recv_object_list|pickle\.loads?|weights_only=False)\b")
    found = sorted(module for module, text in module_sources().items() if unpicklers.search(_code(text)))
    assert found == []


def _code(text: str) -> str:
    """The source without its docstrings and comments (they may name os.environ)."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)
