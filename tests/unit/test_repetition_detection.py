"""vLLM's repetition_detection: which token tails repeat a pattern, and the checks on its values."""

import pytest

from pagedkv.params.repetition import RepetitionDetectionParams
from pagedkv.params.sampling import SamplingParams


@pytest.mark.parametrize("tokens, sizes, count, repeats", [
    ([1, 2, 3, 3, 3], (1, 1), 3, True),
    ([1, 2, 3, 3], (1, 1), 3, False),
    ([9, 1, 2, 1, 2, 1, 2], (1, 2), 3, True),  # "1 2" three times
    ([9, 1, 2, 1, 2, 1, 2], (1, 1), 3, False),  # no single token three times in a row
    ([1, 2, 1, 2, 1, 2], (3, 4), 2, False),  # patterns of 3-4 only: "1 2 1" then "2 1 2" differ
    ([1, 2, 3, 4, 1, 2, 3, 4], (3, 4), 2, True),
    ([5, 5, 5, 5], (0, 2), 4, True),  # min_pattern_size 0 means 1
    ([1, 2, 3], (2, 2), 2, False),  # shorter than size * count
])
def test_a_tail_repeats_only_where_its_pattern_does(tokens, sizes, count, repeats):
    params = RepetitionDetectionParams(min_pattern_size=sizes[0], max_pattern_size=sizes[1], min_count=count)
    assert params.repeats(tokens) is repeats


@pytest.mark.parametrize("fields, message", [
    ({"max_pattern_size": 2, "min_count": 1}, "min_count must be >= 2"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": -1}, "must be >= 0"),
    ({"max_pattern_size": 2.5, "min_count": 2}, "must be integers"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=f"^repetition_detection .*{message}"):
        SamplingParams(repetition_detection=fields)
    assert not RepetitionDetectionParams().on  # (all zero: off)
