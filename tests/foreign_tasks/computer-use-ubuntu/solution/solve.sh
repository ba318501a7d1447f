#!/bin/bash
curl -s http://desktop:8000/ > /app/out.txt
