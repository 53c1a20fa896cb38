"""Parallelism that training and inference share, below both: the process layout and device
mesh (distributed.py), the `ParallelSection` config section (config.py) and a family's
tensor-parallel plan applied to a model (tensor_parallel.py). Training-only wrapping (FSDP2,
activation checkpointing, float8, compile) stays in `lmforge.train.parallelize`."""
