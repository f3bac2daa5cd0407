"""Where the checklist is graded: `checklist` (each item from evidence about the user's job: the
plan, the runs, the code check; never a pass from this tool's own settings) and `scaling` (the
pmap step against the jit step at several device counts: efficiency, ratios, losses matched).

May use `results`, `config`, `hardware`, `common` and `codecheck`; no JAX.
"""
