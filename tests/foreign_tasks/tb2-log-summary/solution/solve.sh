#!/bin/bash
python3 - << 'EOF'
import collections
codes = collections.Counter(line.split('"')[2].split()[0] for line in open("/app/access.log"))
rows = sorted(codes.items(), key=lambda kv: (-kv[1], kv[0]))
open("/app/report.txt", "w").write("".join(f"{c} {n}\n" for c, n in rows))
EOF
