#!/bin/bash
mkdir -p /logs/verifier
cd /app
status=0
[ "$(git log -1 --format=%s 2>/dev/null)" = "update docs" ] || status=1
[ "$(git rev-list --count HEAD 2>/dev/null)" = "2" ] || status=1
[ -z "$(git status --porcelain 2>/dev/null)" ] || status=1
git show --name-only --format= HEAD 2>/dev/null | grep -qx NOTES.md || status=1
git show --name-only --format= HEAD 2>/dev/null | grep -qx README.md || status=1

if [ "$status" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
