"""A line budget for the core (everything but ops/ and examples/), so growth has to be argued for."""

import pathlib

CORE_BUDGET = 1880  # non-blank, non-comment lines in fgraph/ outside fgraph/ops/ (session 6: +80 for
# fgraph.repeated, which makes a model's trace ~2.5x faster: capture's largest cost)
MODULE_BUDGET = 500  # raw lines per module, anywhere in the package and the examples


def code_lines(path: pathlib.Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#"))


def test_core_line_budget():
    root = pathlib.Path(__file__).parent.parent / "fgraph"
    core = [p for p in root.rglob("*.py") if "ops" not in p.relative_to(root).parts]
    total = sum(code_lines(p) for p in core)
    assert total <= CORE_BUDGET, f"fgraph core has {total} code lines (budget {CORE_BUDGET}): fold before growing"


def test_modules_stay_small():
    top = pathlib.Path(__file__).parent.parent
    big = {
        str(p.relative_to(top)): n
        for p in [*top.glob("fgraph/**/*.py"), *top.glob("examples/*.py")]
        if (n := len(p.read_text().splitlines())) > MODULE_BUDGET
    }
    assert not big, f"modules over {MODULE_BUDGET} lines: {big}"
