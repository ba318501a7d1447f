#!/bin/bash
printf '# greeter\n\nPut a name in config.txt, then run ./greet.sh.\n' > /app/README.md
