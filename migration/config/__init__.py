"""What a user asks for, and whether it is allowed: `requests` (the run config and the plan request,
validated once at the edge), `limits` (every field's allowed values and the error that names a bad
one), `fields` (the form's field table: the UI, the API, the command line and validation are built
from it), `forms` (raw values from a form, an API call or a flag, checked), `distributed` (a
multi-process job's settings).

May use `hardware`, `common` and the workloads (only when a value is checked: they import JAX);
no JAX at import.
"""
