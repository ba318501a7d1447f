import http.server


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"42")


http.server.ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
