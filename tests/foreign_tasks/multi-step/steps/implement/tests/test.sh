#!/bin/bash
source /tests/helpers.sh
: "${EXPECTED_NAME:?set by the verifier env of this step}"
echo "$EXPECTED_NAME" > /app/config.txt
[ "$(/app/greet.sh)" = "$EXPECTED_GREETING" ] || fail
[ "$(/app/greet.sh)" = "$(cat /tests/expected.txt)" ] || fail
echo World > /app/config.txt
[ "$(/app/greet.sh)" = "Hello, World!" ] && pass
fail
