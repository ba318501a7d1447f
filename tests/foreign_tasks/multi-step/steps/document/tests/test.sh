#!/bin/bash
source /tests/helpers.sh
grep -q "greet.sh" /app/README.md 2>/dev/null && grep -q "config.txt" /app/README.md && pass
fail
