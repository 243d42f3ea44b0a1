import pytest

from roll_ds.config.device_mapping import DeviceMappingError, parse_device_mapping


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("list(range(0,16))", list(range(16))),
        ("list(range(0, 8, 2))", [0, 2, 4, 6]),
        ("list(range(4))", [0, 1, 2, 3]),
        ("[0,1,2]", [0, 1, 2]),
        ("[ 3, 5 ]", [3, 5]),
        ("[]", []),
        ("0-3", [0, 1, 2, 3]),
        ("0-1,4-5", [0, 1, 4, 5]),
        ("0,2,4", [0, 2, 4]),
        ("7", [7]),
        (7, [7]),
        ([0, 1], [0, 1]),
        (None, []),
    ],
)
def test_accepted_forms(value, expected):
    assert parse_device_mapping(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("__import__('os').system('x')", "cannot parse"),
        ("list(range(0,4,0))", "step must not be 0"),
        ("[0,a]", "list of integers"),
        ("3-1", "runs backwards"),
        ("[0,0,1]", "repeat"),
        ("", "empty device_mapping"),
        ([0, "1"], "must be integers"),
        (True, "expected"),
        ("list(range(-2,2))", ">= 0"),
        (1.5, "expected"),
    ],
)
def test_rejected_forms_explain(value, message):
    with pytest.raises(DeviceMappingError, match=message):
        parse_device_mapping(value)
