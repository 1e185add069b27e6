"""An admission hook for tests (`explorer.admission: tests.integration.slow_admission:SlowAdmission`): admits one
task per batch, after a pause, so that an explorer is still busy when a test kills it. It also exercises the
Admission interface: partial admission (the rest is given back to the topic) and the finish/fail notifications; the
rest of the interface (set_version, wait, close) it takes from `AdmitAll`, as a plug-in may."""
from __future__ import annotations

import time

from rft.explorer.admission import AdmitAll


class SlowAdmission(AdmitAll):
    PAUSE_S = 1.0

    def __init__(self, cfg, explorer_id: str):
        self.explorer_id = explorer_id
        self.finished = self.failed = 0

    def admit(self, n: int) -> int:
        time.sleep(self.PAUSE_S)
        return min(n, 1)

    def finish(self, n: int) -> None:
        self.finished += n

    def fail(self, n: int) -> None:
        self.failed += n
