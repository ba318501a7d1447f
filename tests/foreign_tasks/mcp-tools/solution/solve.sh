#!/bin/bash
curl -s http://mcp-server:8000/ > /app/out.txt
