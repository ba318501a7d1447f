"""Evaluation on held-out prompts, tied to the step whose weights produced the results.

`shared.py` evaluates on the rollout engines themselves (between training steps, with the weights
just pushed); results are logged at that step.
"""
