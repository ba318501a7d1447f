# shared by every step's test.sh (the top-level tests/ lies under each step's own)
pass() { echo 1 > /logs/verifier/reward.txt; exit 0; }
fail() { echo 0 > /logs/verifier/reward.txt; exit 0; }
