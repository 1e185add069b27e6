"""docs/config.md is generated from the config tree; this keeps it current (regenerate with
`python -m rft.ops.config_reference`)."""
from rft.ops.config_reference import main


def test_config_reference_is_current():
    assert main(["--check"]) == 0, "docs/config.md is stale: run `python -m rft.ops.config_reference`"


def test_no_tracked_file_holds_merge_conflict_markers():
    import re
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.M)
    found = [name for name in files if (repo / name).suffix in {".py", ".md", ".yaml", ".txt", ".js", ".html", ".css"}
             and (repo / name).is_file() and marker.search((repo / name).read_text(errors="replace"))]
    assert found == [], f"merge conflict markers left in {found}"
