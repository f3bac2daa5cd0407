"""The migration backend: run configs, precision and remat policies, the training step, the
isolated runner and its reports. Never imports gradio.

This package's top level imports nothing heavy: a worker process must be able to set JAX's
environment variables before JAX is first imported.
"""
