"""experiments/async_staleness.py: the design's reading of a paired gap, and its control arm."""
import sys

import pytest

from tests.cli.test_evaluate import script

a = script("async_staleness")


@pytest.mark.parametrize("low, high, verdict", [
    (-0.12, -0.01, "costs"),            # below 0, however far
    (-0.049, 0.05, "costs nothing"),    # inside the ±5-point margin, its edge included
    (-0.051, 0.02, "not resolved"),     # reaches past the margin below, not below 0
    (-0.03, 0.08, "not resolved"),      # past it above
    (0.01, 0.04, "costs nothing"),      # above 0 and inside the margin: stale is not worse
])
def test_verdict_on_cost(low, high, verdict):
    assert a.verdict_on_cost(low, high) == verdict


def test_the_on_policy_control_is_required(capsys, monkeypatch):
    # experiments/common.py, whatever another test file in this worker imported as `common`
    monkeypatch.setitem(sys.modules, "common", script("common"))
    with pytest.raises(SystemExit) as exc:
        a.main(["--staleness", "1", "2", "--out", "unused"])
    assert exc.value.code == 2
    assert "--staleness must include 0" in capsys.readouterr().err
