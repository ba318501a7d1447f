#!/bin/bash

apt-get update
apt-get install -y curl

curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh

source $HOME/.local/bin/env

correct=0
fast=0
uvx --with pytest==8.4.1 pytest /tests/test_correct.py -rA && correct=1
uvx --with pytest==8.4.1 pytest /tests/test_fast.py -rA && fast=1
python3 -c "import json; json.dump({'correctness': $correct, 'speed': $fast}, open('/logs/verifier/reward.json', 'w'))"
