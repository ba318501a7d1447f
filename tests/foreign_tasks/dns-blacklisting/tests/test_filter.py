from pathlib import Path


def test_reachable():
    assert Path("/app/reachable.txt").read_text().split() == ["news.example", "weather.example"]
