#!/bin/bash
cat > /app/greet.sh <<'SH'
#!/bin/bash
echo "Hello, ${1:-world}!"
SH
chmod +x /app/greet.sh
