"""The admission interface (rft/explorer/admission.py `Admission`): every implementation has every method the
explorer calls, and a plugin (`explorer.admission: package.module:factory`) that lacks one is refused when the
explorer is composed, naming the key and each missing method."""
from __future__ import annotations

import pytest

from rft.config import ConfigError
from rft.explorer.admission import ADMISSION_METHODS, AdmitAll, StalenessAdmission, checked
from tests.integration.slow_admission import SlowAdmission


def test_the_interface_declares_every_method_the_explorer_calls():
    assert ADMISSION_METHODS == ("admit", "finish", "fail", "set_version", "wait", "close")
    for admission in (AdmitAll(), StalenessAdmission(groups_per_step=2, max_staleness=1), SlowAdmission(None, "e")):
        assert checked(admission) is admission


def test_a_plugin_without_every_method_is_refused_by_name():
    class OnlyAdmit:
        def admit(self, n: int) -> int:
            return n

    with pytest.raises(ConfigError, match=r"^explorer\.admission: OnlyAdmit lacks finish, fail, set_version, wait, "
                                          r"close \(every method of the Admission interface"):
        checked(OnlyAdmit())
