"""Harbor-format tasks (Terminal-Bench 2 and many agent datasets): reading them (task.py), one episode
per task in a fresh sandbox with the agent's tools and the task's verifier (episode.py), the oracle
check of a dataset (check.py) and a generator of small tasks (generate.py)."""
