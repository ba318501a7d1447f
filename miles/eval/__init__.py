"""Evaluation, tied to the step whose weights produced each result.

modes.py     the three modes (eval.mode: shared, dedicated, external) and the bookkeeping that
             puts each result in the record of its step (lag, skips, mixed-version check)
snapshot.py  a step's weights as a Hugging Face directory with a `.complete` marker
runner.py    dedicated eval engines and external functions, off the training thread
cli.py       `miles eval RUN_DIR --step N [--submit]`
shared.py    evaluate_suites: every dataset on a given set of engines (all modes call it)
datasets.py, metrics.py, scoring.py   datasets, pass@k / mean@n, scorers
"""
