"""The read-only web view of runs: `miles dashboard RUN_DIR ...` (app.py; the page is in static/)."""
