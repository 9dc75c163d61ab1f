"""The house's size rules: modules small enough to read in one sitting, test files too, few modules flat in the
package, and no Triton kernel outside the rooms that hold them (fgraph/kernels/, and the ops that own theirs)."""

import pathlib

TOP = pathlib.Path(__file__).parent.parent
MODULE_BUDGET = 500  # raw lines per module
TEST_BUDGET = 600  # raw lines per test file
FLAT_BUDGET = 12  # modules directly in fgraph/


def lines(p: pathlib.Path) -> int:
    return len(p.read_text().splitlines())


def test_modules_stay_small():
    big = {
        str(p.relative_to(TOP)): n
        for p in [*TOP.glob("fgraph/**/*.py"), *TOP.glob("examples/**/*.py")]
        if (n := lines(p)) > MODULE_BUDGET
    }
    assert not big, f"modules over {MODULE_BUDGET} lines: {big}"


def test_test_files_stay_small():
    big = {str(p.relative_to(TOP)): n for p in TOP.glob("tests/**/*.py") if (n := lines(p)) > TEST_BUDGET}
    assert not big, f"test files over {TEST_BUDGET} lines: {big}"


def test_few_modules_sit_flat_in_the_package():
    flat = sorted(p.name for p in (TOP / "fgraph").glob("*.py"))
    assert len(flat) <= FLAT_BUDGET, f"{len(flat)} modules flat in fgraph/: {flat}"


def test_triton_kernels_live_in_kernels_or_with_their_op():
    stray = [
        str(p.relative_to(TOP))
        for p in TOP.glob("fgraph/**/*.py")
        if "@triton.jit" in p.read_text() and p.parent.name not in ("kernels", "ops")
    ]
    assert not stray, f"Triton kernels outside fgraph/kernels/ and fgraph/ops/: {stray}"
