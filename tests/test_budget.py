"""Modules stay small enough to read in one sitting: a cap per module, anywhere in the package and the examples."""

import pathlib

MODULE_BUDGET = 500  # raw lines per module


def test_modules_stay_small():
    top = pathlib.Path(__file__).parent.parent
    big = {
        str(p.relative_to(top)): n
        for p in [*top.glob("fgraph/**/*.py"), *top.glob("examples/**/*.py")]
        if (n := len(p.read_text().splitlines())) > MODULE_BUDGET
    }
    assert not big, f"modules over {MODULE_BUDGET} lines: {big}"
