"""Where a run starts and is measured: `runner` (a worker process per run or plan: start, stream its
events, cancel, time out), `worker` (the process's entry point: limits, lifeline, heartbeat, then
the run, plan, probe or code check), `worker_env` (what JAX is told before import), `measure` (one
measured run, in stages), `multiprocess` (joining a jax.distributed job), `checkpoint`
(Orbax train states), `profiling` and `env_report`.

May use `planning`, `step`, `results`, `config`, `hardware`, `common`, `codecheck` and the
workloads; JAX only inside workers.
"""
