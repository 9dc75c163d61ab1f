"""The house rules of fgraph's layout: no import cycle (deferred imports included), subpackages are imported
through their faces, and fgraph.ops builds on the op-author API (fgraph.extend) alone."""

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent / "fgraph"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, tuple[str, bool]]:
    """module name -> (source, is a package's __init__)."""
    return {module_name(p): (p.read_text(), p.name == "__init__.py") for p in sorted(ROOT.rglob("*.py"))}


def imports(name: str, source: str, is_package: bool, known: set[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names taken from it) for every import in a module, at any depth (a deferred import counts too).
    `from pkg import sub` where sub is a module is an import of pkg.sub."""
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = [a.name for a in node.names if f"{base}.{a.name}" in known]
            out += [(f"{base}.{s}", ()) for s in subs]
            rest = tuple(a.name for a in node.names if a.name not in subs)
            if rest or not subs:
                out.append((base, rest))
    return [(m, names) for m, names in out if m == "fgraph" or m.startswith("fgraph.")]


def owner(module: str) -> str:
    """The package a module belongs to: fgraph itself, or a subpackage (fgraph.trace, fgraph.ops, ...)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and not parts[1].startswith("_") and parts[1] != "extend" else "fgraph"


def violations(mods: dict[str, tuple[str, bool]]) -> list[str]:
    """What breaks the house rules, one line each."""
    known, bad = set(mods), []
    for name, (src, is_package) in mods.items():
        home = owner(name)
        for target, names in imports(name, src, is_package, known):
            there = owner(target)
            if home == "fgraph.ops":
                if there != "fgraph.ops" and target != "fgraph.extend":
                    bad.append(f"{name} imports {target}: fgraph.ops builds on fgraph.extend alone")
            elif there != "fgraph" and there != home:
                if target != there:
                    bad.append(f"{name} imports {target}, past the face of {there}")
                bad += [f"{name} imports the private {target}.{n}" for n in names if n.startswith("_")]
    return bad


def cycle(mods: dict[str, tuple[str, bool]]) -> list[str] | None:
    """An import cycle among fgraph's modules (a package's face counts as a module), or None."""
    known = set(mods)
    deps = {n: {m for m, _ in imports(n, *mods[n], known) if m in known and m != n} for n in mods}
    try:
        tuple(graphlib.TopologicalSorter(deps).static_order())
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_fgraph_has_no_import_cycle():
    assert cycle(sources()) is None


def test_subpackages_are_imported_through_their_faces_and_ops_through_extend():
    assert violations(sources()) == []


def test_the_capture_stage_has_its_folder():
    names = set(sources())
    assert {"fgraph.trace", "fgraph.padding", "fgraph.capture", "fgraph.ops", "fgraph.extend"} <= names
    assert "fgraph.capture._entry" in names and "fgraph.trace._traced" in names


@pytest.mark.parametrize(
    "mods, found",
    [
        (  # a deferred import that closes a circle
            {
                "fgraph.a": ("from . import b\n", False),
                "fgraph.b": ("def f():\n    from .a import x\n", False),
            },
            "cycle",
        ),
        (  # past a subpackage's face
            {
                "fgraph.trace": ("", True),
                "fgraph.trace._m": ("", False),
                "fgraph._j": ("from .trace._m import f\n", False),
            },
            "fgraph._j imports fgraph.trace._m, past the face of fgraph.trace",
        ),
        (  # a private name through the face
            {"fgraph.trace": ("", True), "fgraph._j": ("from .trace import _f\n", False)},
            "fgraph._j imports the private fgraph.trace._f",
        ),
        (  # an op module reaching into the core
            {"fgraph.ops": ("", True), "fgraph.ops.m": ("from fgraph._signature import Batched\n", False)},
            "fgraph.ops.m imports fgraph._signature: fgraph.ops builds on fgraph.extend alone",
        ),
    ],
)
def test_the_rules_find_what_breaks_them(mods, found):
    if found == "cycle":
        assert sorted(set(cycle(mods))) == ["fgraph.a", "fgraph.b"]
    else:
        assert violations(mods) == [found]
