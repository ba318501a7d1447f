#!/bin/bash
curl -s http://api-server:5000/ > /app/out.txt
