from pathlib import Path


def test_greeting_file():
    assert Path("/app/greeting.txt").read_text() == "Good morning!\n"
