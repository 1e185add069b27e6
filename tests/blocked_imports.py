"""Subprocesses in which some top-level modules cannot be imported, as if they were not installed: an import hook in
a sitecustomize on PYTHONPATH (tests/integration/test_extras.py blocks the extras,
tests/integration/test_cli_without_torch.py blocks torch)."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def blocking_env(directory: Path, modules: list[str]) -> dict[str, str]:
    """The environment of a subprocess that cannot import `modules` (top-level names) or anything below them: the
    hook is written to `directory`. An import of one raises ModuleNotFoundError "... (blocked by the test)"."""
    (directory / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import sys

        BLOCKED = {sorted(modules)!r}


        class Block:
            '''Refuses the blocked modules, as if they were not installed.'''

            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
                return None


        sys.meta_path.insert(0, Block())
        """))
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(directory), str(REPO)]), RFT_DEBUG="")
