import sys

sys.path.insert(0, "/app")
from stats import mean, median  # noqa: E402

assert median([3, 1, 2]) == 2
assert median([4, 1, 3, 2]) == 2.5
assert median([10, 20]) == 15
assert median([5]) == 5
assert mean([1, 2, 3, 4]) == 2.5
print("all tests passed")
