"""Pieces of the RL loop (miles/loop.py): rank-0 rollout side, loop state across restarts."""
