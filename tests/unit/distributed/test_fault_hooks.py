"""The test hooks' trigger (``hang_hook.armed``): inert unless set, fires once per marker."""

import pytest

from roll_ds.distributed.hang_hook import armed

ENV = "ROLL_DS_TEST_SOME_HOOK"


def test_unset_is_inert(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not armed(ENV, 1)


def test_fires_at_its_count_once_per_marker(monkeypatch, tmp_path):
    marker = tmp_path / "fired"
    monkeypatch.setenv(ENV, f"3:{marker}")
    assert [armed(ENV, n) for n in (1, 2, 3)] == [False, False, True]
    assert marker.exists()
    assert not armed(ENV, 3)  # a replacement counting to 3 again goes on


def test_a_spec_without_a_marker_names_the_format(monkeypatch):
    monkeypatch.setenv(ENV, "3")
    with pytest.raises(ValueError, match="<n>:<marker file>"):
        armed(ENV, 3)
