"""Where runs execute: `executors.make_executor` chooses this machine (`running.runner.LocalExecutor`)
or a Ray cluster (`ray_cluster`: runs and catalog plans as Ray actors, each starting the same worker
process a local run does). May use `running` and below; imports Ray only when a cluster is set.
"""
