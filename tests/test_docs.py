"""Every error class has its section in docs/errors.md, which its messages link to."""

import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys

import examples
import fgraph
import fgraph.ops

ROOT = pathlib.Path(__file__).parent.parent


OPTIONAL = {"triton"}  # packages that modules of their own import at the top (fgraph.ops._attn_triton_kernels)


def error_classes() -> set[type]:
    for pkg in (fgraph, fgraph.ops, examples):
        for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            try:
                importlib.import_module(m.name)
            except ModuleNotFoundError as e:
                if e.name not in OPTIONAL:
                    raise
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


def test_the_readme_example_runs_as_pasted():
    """The README's first Python block runs on its own, in a fresh interpreter, and prints what explain prints."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert blocks, "README.md has no ```python block"
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # this checkout's fgraph, whatever is installed
    run = subprocess.run(
        [sys.executable, "-c", blocks[0]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"the README example failed:\n{run.stdout}\n{run.stderr}"
    assert "step(routine='decode', bucket=2)" in run.stdout, run.stdout
    assert "break attention" in run.stdout, run.stdout
