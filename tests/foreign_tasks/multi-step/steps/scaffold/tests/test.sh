#!/bin/bash
source /tests/helpers.sh
[ -x /app/greet.sh ] && [ "$(/app/greet.sh)" = hello ] && pass
fail
