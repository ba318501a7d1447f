#!/bin/bash
mkdir -p /logs/verifier
[ -s /app/note.txt ] && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
