"""Planning a run before it starts: which layout (strategy, expert, pipeline and data parallelism, micro-batch,
activation checkpointing) fits a cluster's GPUs and which is fastest. hardware.py names the GPUs and links with
their datasheet figures, memory.py predicts each rank's peak bytes, time_model.py its step time, layouts.py
enumerates and ranks the layouts the platform accepts; `moe-plan` (launch/plan.py) prints them. Imports the
parallel and train wings only to build one rank for real on the meta device (simulate.py)."""
