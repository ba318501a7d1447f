#!/bin/bash
mkdir -p /logs/verifier
python3 - <<'PY'
import json, sys
try:
    cfg = json.load(open("/app/config.json"))
except Exception as e:
    print("does not parse:", e); sys.exit(1)
want = {"name": "inventory", "port": 8080, "debug": False, "workers": 4, "paths": ["/data", "/cache"]}
sys.exit(0 if cfg == want else 1)
PY
status=$?

if [ "$status" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
