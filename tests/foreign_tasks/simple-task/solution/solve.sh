#!/bin/bash

echo 'Good morning!' > greeting.txt
