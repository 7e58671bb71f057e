"""A run's plan and its launch (driver side): plan.py (the run planned once: checks.py,
memory_plan.py, place.py), launch.py (the `train` command's run stage on the plan alone), trainer.py
(the Ray wiring), alongside.py (a driver stage in a thread) and result.py (what `train()` returns).
Nothing is imported here: `import orchestrator.run.x` loads only x."""
