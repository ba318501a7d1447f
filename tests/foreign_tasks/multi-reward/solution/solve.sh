#!/bin/bash

cat > /app/merge.py << 'EOF'
def merge_intervals(pairs):
    out = []
    for a, b in sorted(pairs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
EOF
