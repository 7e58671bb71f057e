"""What reports a run to the person who started it (driver side): console.py (the driver's output),
progress.py (step lines), plots.py, startup.py (the start-up clock), cost.py (the cost ledger and
its prices), autopilot.py (the autopilot's table) and ui.py (`orchestrator ui`). Nothing is imported
here."""
