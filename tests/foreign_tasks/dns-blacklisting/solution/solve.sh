#!/bin/bash

while read -r host; do
  code=$(curl -s -o /dev/null -w '%{http_code}' -H "Host: $host" http://127.0.0.1:8053/)
  [ "$code" = 200 ] && echo "$host"
done < /etc/candidate-hosts.txt | sort > /app/reachable.txt
