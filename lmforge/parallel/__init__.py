"""Parallelism that training and inference share, below both: the process layout and device
mesh (distributed.py), the `ParallelSection` config section (config.py) and a family's
tensor-parallel plan applied to a model (tensor_parallel.py), and expert parallelism: a MoE's
experts split over the ep axis, tokens moved by all-to-all (expert_parallel.py). Training-only wrapping (FSDP2,
activation checkpointing, float8, compile) stays in `lmforge.train.parallelize`."""
