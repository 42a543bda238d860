"""The README's claims that code can check: its library example runs, its recipe table's bytes/param are the
recipes' own."""

import re
from pathlib import Path

from lowbit.recipes import RECIPES

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
