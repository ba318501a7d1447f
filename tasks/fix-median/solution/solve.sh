#!/bin/bash
# the even-length branch is the function's last line: return the mean of the two middle values
python3 - <<'PY'
from pathlib import Path
p = Path("/app/stats.py")
head, sep, tail = p.read_text().rpartition("    return ordered[middle]\n")
p.write_text(head + "    return (ordered[middle - 1] + ordered[middle]) / 2\n" + tail)
PY
