#!/bin/bash
# runs in the working directory before the agent's turn
chmod 644 config.txt
