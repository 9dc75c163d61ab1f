"""Every error class has its section in docs/errors.md, which its messages link to."""

import importlib
import pathlib
import pkgutil

import examples
import fgraph
import fgraph.ops

ROOT = pathlib.Path(__file__).parent.parent


def error_classes() -> set[type]:
    for pkg in (fgraph, fgraph.ops, examples):
        for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            importlib.import_module(m.name)
    todo, seen = [fgraph.FgraphError], set()
    while todo:
        cls = todo.pop()
        if cls not in seen and not cls.__module__.startswith("tests"):
            seen.add(cls)
            todo.extend(cls.__subclasses__())
    return seen


def test_every_error_class_has_a_section_its_messages_link_to():
    page = (ROOT / "docs" / "errors.md").read_text()
    headings = {line[3:].strip() for line in page.splitlines() if line.startswith("## ")}
    missing = sorted(c.__name__ for c in error_classes() if c.__name__ not in headings)
    assert not missing, f"docs/errors.md has no section for {missing}"
    assert str(fgraph.TraceError("what", "fix")).endswith("See: docs/errors.md#traceerror")
