"""The repository's tracked files (read with `git ls-files`) hold no merge conflict markers."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path


def test_no_tracked_file_holds_merge_conflict_markers():
    repo = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.M)
    found = [name for name in files if (repo / name).suffix in {".py", ".md", ".yaml", ".txt", ".js", ".html", ".css"}
             and (repo / name).is_file() and marker.search((repo / name).read_text(errors="replace"))]
    assert found == [], f"merge conflict markers left in {found}"
