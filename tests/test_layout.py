"""The package's layout: no import cycles among lowbit's modules, no private names imported across them."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def modules() -> dict[str, Path]:
    """Every module under src/lowbit, by dotted name (a package by its own name, for its __init__.py)."""
    out = {}
    for path in sorted((SRC / "lowbit").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> list[tuple[str, int, list[str]]]:
    """(module, line, names) for each `lowbit.*` import in the file, at module level or inside a function: the
    module imported, or for `from pkg import x` the submodule pkg.x where x is one."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, []) for a in node.names if a.name.split(".")[0] == "lowbit"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            if base.split(".")[0] != "lowbit":
                continue
            names = [a.name for a in node.names]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in known]
            plain = [n for n in names if f"{base}.{n}" not in known]
            out += [(s, node.lineno, []) for s in subs]
            if plain or not subs:
                out.append((base, node.lineno, plain))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {m: set() for m in known}
    for m, path in known.items():
        for target, _, _ in imports(m, path, known):
            # importing lowbit.a.b runs lowbit/__init__ and lowbit/a/__init__ first, but a package's own
            # __init__ importing its submodules is what a package is: only the module itself is an edge
            if target in known and target != m:
                edges[m].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (its modules, the first repeated at the end), or None."""
    state, stack = {}, []  # state: 1 on the stack, 2 done

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    edges = graph()
    assert sum(map(len, edges.values())) > 50  # the parse found the imports
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_names_imported_across_modules():
    known = modules()
    bad = [f"{path.relative_to(SRC)}:{line}: from {target} import {n}"
           for m, path in known.items() for target, line, names in imports(m, path, known)
           for n in names if n.startswith("_") and not n.endswith("__") and target != m]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)
