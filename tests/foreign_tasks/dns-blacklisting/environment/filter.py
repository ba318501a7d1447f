import http.server

BLOCKED = set(open("/etc/blocked.txt").read().split())


class Filter(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        host = self.headers.get("Host", "").split(":")[0]
        self.send_response(403 if host in BLOCKED else 200)
        self.end_headers()


http.server.ThreadingHTTPServer(("127.0.0.1", 8053), Filter).serve_forever()
