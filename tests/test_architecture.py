"""The package graph: which package may import which, no cycles, a leaf that stays a leaf,
and no module past 400 lines. Every import counts, function-local ones and
`importlib.import_module("literal")` included; only `if TYPE_CHECKING:` blocks are exempt
(they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("serve", "router", "kvtransfer", "bench")
# importer -> packages it must never import
FORBIDDEN = {
    "serve": {"bench"},
    "router": {"serve", "bench", "kvtransfer"},
    "kvtransfer": {"serve", "bench", "router"},
}
LEAF = "serve.common"  # imports nothing of pdserve
MAX_LINES = 400


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, module: str) -> set[str]:
    """Absolute names of every pdserve module `path` imports, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_pkg else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {n for n in found if n.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    mods = modules()
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for imp in imports_of(path, name):
            # `from pkg import sub` names a module when one exists; else it is an attribute of pkg.
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                targets.add(imp)
        out[name] = targets
    return out


def test_forbidden_imports():
    bad = []
    for mod, targets in graph().items():
        top = mod.split(".")[0]
        for t in targets:
            if t.split(".")[0] in FORBIDDEN.get(top, ()):
                bad.append(f"{mod} -> {t}")
            if mod.startswith(LEAF) and not t.startswith(LEAF):
                bad.append(f"{mod} -> {t} (the leaf imports nothing of pdserve)")
    assert not bad, "\n".join(sorted(bad))


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def _package_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    pg: dict[str, set[str]] = {}
    for mod, targets in g.items():
        pg.setdefault(mod.split(".")[0], set()).update(t.split(".")[0] for t in targets if t.split(".")[0]
                                                       != mod.split(".")[0])
    return pg


def test_no_import_cycles():
    g = graph()
    # A package's __init__ re-exporting its submodules is not a cycle of concepts.
    g = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in g.items()}
    assert _cycles(_package_graph(g)) == []
    assert _cycles(g) == []


def test_the_checker_sees_function_local_and_importlib_imports(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("import os\n\ndef f():\n    from bench.cli import x\n    import importlib\n"
                   "    importlib.import_module('bench.plan')\n\nif TYPE_CHECKING:\n    import bench.loadgen\n")
    assert imports_of(src, "serve.mod") == {"bench.cli", "bench.cli.x", "bench.plan"}
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_module_over_400_lines(pkg):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
