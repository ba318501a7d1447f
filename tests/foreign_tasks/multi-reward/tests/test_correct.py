import sys

sys.path.insert(0, "/app")
from merge import merge_intervals


def test_merges():
    assert merge_intervals([(5, 7), (1, 3), (2, 4)]) == [(1, 4), (5, 7)]
