#!/bin/bash
mkdir -p /logs/verifier
status=0
[ -x /app/greet.sh ] || status=1
[ "$(/app/greet.sh Ada 2>/dev/null)" = "Hello, Ada!" ] || status=1
[ "$(/app/greet.sh 'Grace Hopper' 2>/dev/null)" = "Hello, Grace Hopper!" ] || status=1
[ "$(/app/greet.sh 2>/dev/null)" = "Hello, world!" ] || status=1

if [ "$status" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
