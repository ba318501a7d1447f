import collections
from pathlib import Path

import six  # installed by the image's build: the test fails where the build's RUN did not run

codes = collections.Counter(line.split('"')[2].split()[0] for line in open("/app/access.log"))
want = [f"{c} {n}" for c, n in sorted(codes.items(), key=lambda kv: (-kv[1], kv[0]))]
got = Path("/app/report.txt").read_text().split("\n")
assert [x for x in got if x] == want, (got, want)
print("ok", six.__name__)
