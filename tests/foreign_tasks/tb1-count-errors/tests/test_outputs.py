from pathlib import Path


def test_count():
    assert Path("/app/errors.txt").read_text().strip() == "3"
