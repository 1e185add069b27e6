"""docs/config.md is generated from the config tree; this keeps it current (regenerate with
`python -m tools.config_reference`)."""
from tools.config_reference import main


def test_config_reference_is_current():
    assert main(["--check"]) == 0, "docs/config.md is stale: run `python -m tools.config_reference`"
