#!/bin/bash
mkdir -p /logs/verifier
cd /app && python3 /tests/test_stats.py
status=$?

if [ "$status" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
