"""The command line, `python -m migration`: `parser` (the flags, those of the form's fields built from
`migration/config/fields.py`), `commands` (one function per subcommand) and `output` (what they
print). A layer over the service: it may use any of the backend; nothing in the backend uses it.
The `check` command must run where JAX is not installed: module-level imports here stay JAX-free.
"""
