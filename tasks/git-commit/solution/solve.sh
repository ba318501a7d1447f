#!/bin/bash
cd /app && git add -A && git commit -q -m "update docs"
