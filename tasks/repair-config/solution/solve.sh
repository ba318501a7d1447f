#!/bin/bash
cat > /app/config.json <<'JSON'
{
  "name": "inventory",
  "port": 8080,
  "debug": false,
  "workers": 4,
  "paths": ["/data", "/cache"]
}
JSON
