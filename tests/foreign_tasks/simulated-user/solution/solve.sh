#!/bin/bash
curl -s http://user-server:8000/ > /app/out.txt
