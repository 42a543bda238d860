"""The docs' claims that code can check: the README's library example and docs/library.md's examples run, the
README's recipe table's bytes/param are the recipes' own; BENCHMARKS.md's generated tables match their JSON and
every file it names exists."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit.numerics.recipes import RECIPES

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_library_example_runs():
    code = re.search(r"## As a library\n\n```python\n(.*?)```", README, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["loss"].isfinite() and scope["opt"].state  # a step was taken, with states


@pytest.mark.slow
def test_library_page_examples_run():
    """docs/library.md's examples, in order, as one script (its HF model needs transformers)."""
    pytest.importorskip("transformers")
    page = (Path(__file__).parent.parent / "docs" / "library.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 6
    scope: dict = {"__name__": "library_md"}
    exec(compile("\n".join(blocks), "docs/library.md", "exec"), scope)
    assert scope["opt"].state and scope["mine_opt"].state and scope["stats"]
    assert len(scope["chosen"]["converted"]) == 8  # gate and up projections of 4 blocks
    assert scope["kept"] == [f"blocks.{i}.{w} (first/last block)" for i in (0, 3) for w in ("up", "down")] + \
        ["unembed (output head)"]


def test_readme_recipe_table_matches_the_recipes():
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|.*\| \**(\d+)\** \|$", README, re.M)
    assert len(rows) >= 10
    for name, total in rows:
        assert RECIPES[name].optim.bytes_per_param()["total"] == int(total), name


def test_benchmarks_tables_are_their_json_and_every_named_file_exists():
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "report.py"), "--check"], cwd=root,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stdout + out.stderr
