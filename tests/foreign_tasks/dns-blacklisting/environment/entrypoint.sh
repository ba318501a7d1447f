#!/bin/bash
python3 /usr/local/bin/filter.py &
exec "$@"
