"""Doctor's rules, each a small function of a `RunRecord` returning a `Finding` or None, grouped by
what they look at: `speed.py` (where a step's time and memory go: data pipeline, memory headroom,
model state, precision, compile, gradient sync, uneven workers), `run_health.py` (non-finite steps,
start-up, checkpoint reports and interval, evaluation, bookkeeping), `study.py` (a study's size and
the edge of its search space) and `autopilot.py` (an autopilot run's predicted against achieved
speed-up). A rule runs once it is listed in `doctor/engine.py`'s `RULES`."""
