"""The train step every run and every plan compiles: `train` (the jitted step with accumulation in a
scan, its shardings, the TPU-era pmap step beside it) and `policies` (precision and remat, one table
each). May use `config` and the workloads; imports JAX.
"""
