"""The house in numbers: what issue 38 measured, from the code's own imports and text.

    python3 .ci/house.py            # modules directly in numbactr/, files over 800 lines, import circles,
                                    # device-dispatch sites, long module docstrings

Import circles are strongly connected components of the module graph built from every import statement,
including those inside functions (what grimp and import-linter read too). A device-dispatch site is a line
outside runtime/ and ops/dispatch.py that asks which implementation to run (the numba.cuda kernels, the
compiled CPU version or the NumPy reference).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DISPATCH = re.compile(r"uses_kernels\(\)|compiled_cpu\(\)|\b_kernels\(\)|\b_compiled\(\)|reference_ops\(\)")


def modules(root: pathlib.Path = ROOT) -> dict:
    """dotted name -> (path, is_package) for numbactr/ and kernels/ (installed as numbactr.kernels)."""
    out = {}
    for base, pkg in (("numbactr", "numbactr"), ("kernels", "numbactr.kernels")):
        for p in sorted((root / base).rglob("*.py")):
            rel = p.relative_to(root / base)
            if base == "numbactr" and rel.parts[0] == "kernels":
                continue  # the link to kernels/
            parts = [pkg, *rel.with_suffix("").parts]
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def import_graph(mods: dict) -> dict:
    """module -> the numbactr modules it imports (anywhere in the file)."""

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges = collections.defaultdict(set)
    for name, (path, is_pkg) in mods.items():
        pkg = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                r = resolve(t) if t.startswith("numbactr") else None
                if r and r != name:
                    edges[name].add(r)
    return edges


def circles(edges: dict) -> list:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)

    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        visit(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    visit(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def report(root: pathlib.Path = ROOT) -> dict:
    mods = modules(root)
    pkg = root / "numbactr"
    files = [p for p in pkg.rglob("*.py") if "kernels" not in p.relative_to(pkg).parts[:1]]
    lines = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in files}
    dispatch = 0
    for p in files:
        rel = p.relative_to(pkg).as_posix()
        if rel.startswith("runtime/") or rel == "ops/dispatch.py":
            continue
        dispatch += sum(
            1
            for line in p.read_text().splitlines()
            if DISPATCH.search(line) and not line.lstrip().startswith(("#", "def "))
        )
    docs = {}
    for p in files:
        d = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if d and d.count("\n") + 1 > 40:
            docs[str(p.relative_to(root))] = d.count("\n") + 1
    return {
        "modules_in_numbactr": sorted(p.name for p in pkg.glob("*.py")),
        "over_800": {k: v for k, v in sorted(lines.items(), key=lambda kv: -kv[1]) if v > 800},
        "circles": circles(import_graph(mods)),
        "dispatch_sites": dispatch,
        "docstrings_over_40_lines": docs,
    }


if __name__ == "__main__":
    r = report(pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
    print(f"modules directly in numbactr/: {len(r['modules_in_numbactr'])}  ({' '.join(r['modules_in_numbactr'])})")
    print(f"files over 800 lines outside kernels/: {len(r['over_800'])}  {r['over_800']}")
    print(f"import circles: {len(r['circles'])}  {r['circles']}")
    print(f"device-dispatch sites outside runtime/ and ops/dispatch.py: {r['dispatch_sites']}")
    print(f"module docstrings over 40 lines: {len(r['docstrings_over_40_lines'])}  {r['docstrings_over_40_lines']}")
