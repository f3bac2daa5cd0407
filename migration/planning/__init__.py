"""Where the plan is decided: `planner` (the plan's decisions, built once), `search` (the candidates,
the bracketed search, the step-time ranking), `memory` (predicted peaks by compiling for the target,
with or without its device), `source` (the TPU job the plan starts from), `deployment` (the plan's
environment and launch scripts, rebuilt from its decisions), `planfile` (a plan from outside,
checked field by field).

May use `step`, `results`, `config`, `hardware`, `common` and the workloads. Runs inside a planner
worker (`running.worker`), except `deployment` and `planfile`, which the server uses without JAX.
"""
