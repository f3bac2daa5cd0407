"""The shared box's service, what the app and the command line call: `jobs` (the queue: lanes,
owners, per-user limits, records that survive a restart) over `job` (one job, its limits and
events), `orchestrate` (a plan's runs, their history, exports and checklist), `autotune`,
`scaling_runs`, `history` (SQLite) and `accounts` (the users file).

May use everything below it (`cluster`, `running`, `grading`, `planning`, ...); never the UI.
No JAX: every run and plan happens in a worker process.
"""
