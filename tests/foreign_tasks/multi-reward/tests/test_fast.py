import random
import sys
import time

sys.path.insert(0, "/app")
from merge import merge_intervals


def test_fast():
    pairs = [(a, a + random.randint(0, 5)) for a in (random.randint(0, 10**6) for _ in range(100000))]
    t0 = time.time()
    merge_intervals(pairs)
    assert time.time() - t0 < 1.0
