"""The RL loop, a package of four modules (`python -m miles.loop --run-dir RUN_DIR` runs driver.main):

- driver.py: the step loop on every trainer rank: batch -> `TrainBackend.train` -> weight push ->
  evaluation -> metrics -> checkpoint, the sync and fully asynchronous schedules alike;
- rollout_side.py: rank 0's `RolloutSide` (producer, buffer, weight transport, shared evaluation)
  on a background event loop;
- state.py: `LoopState`, what survives a restart (step, data position, metrics file, preemption);
- inputs.py: what the loop builds from a plan (task, reward, episode plug-ins, evaluation), built
  once by the launcher before any process starts.

Importing the package imports none of them (the launcher imports inputs.py on a login node).
"""
