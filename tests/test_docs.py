"""The docs' claims that code can check: the README's library example runs and its recipe table's bytes/param are
the recipes' own; BENCHMARKS.md's generated tables match their JSON and every file it names exists."""

import os
import re
import subprocess
import sys
from pathlib import Path

from lowbit.numerics.recipes import RECIPES

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_library_example_runs():
    code = re.search(r"## As a library\n\n```python\n(.*?)```", README, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["loss"].isfinite() and scope["opt"].state  # a step was taken, with states


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
