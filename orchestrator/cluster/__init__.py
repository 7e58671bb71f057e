"""The Ray cluster a run gets (driver side): local.py (join $RAY_ADDRESS, as under `ray job submit`,
or start a private local cluster; stop only what it started; the Ray Train settings a run gets) and
warm.py (the warm local cluster a command leaves running for the next, and `orchestrator cluster
status|stop`). Nothing is imported here."""
