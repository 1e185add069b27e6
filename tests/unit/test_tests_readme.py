"""tests/README.md maps every test file: each `test_*.py` under tests/ is named in it, and each file it names exists
(a file moved or renamed without the map fails here)."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def unmapped_and_stale(readme: str, files: list[str]) -> tuple[list[str], list[str]]:
    """The test files (stems) the text does not name, and the names in it that are no test file. A name is a
    `test_...` word, optionally after a directory (`e2e/test_x`); one after `::` names a test function, not a file,
and one before `*` a pattern (`test_data_*`)."""
    named = {m.group(1) for m in re.finditer(r"(?<![:\w])(test_\w+)(?!\w|\*)", readme)}
    return sorted(set(files) - named), sorted(named - set(files))


def test_the_readme_names_every_test_file_and_no_other():
    files = [p.stem for p in TESTS.rglob("test_*.py")]
    unmapped, stale = unmapped_and_stale((TESTS / "README.md").read_text(), files)
    assert (unmapped, stale) == ([], []), f"tests/README.md: not named {unmapped}; no such file {stale}"


def test_the_map_check_sees_a_missing_and_a_stale_name():
    readme = "| `rft/a` | `test_a`, `unit/test_b.py` | `test_gone` | test_a.py::test_function_name, `test_x_*` |"
    assert unmapped_and_stale(readme, ["test_a", "test_b", "test_c"]) == (["test_c"], ["test_gone"])
