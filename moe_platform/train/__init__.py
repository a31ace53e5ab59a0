"""The training loop (trainer.py) and what runs inside it: the model build (model_build.py), seeding, the NaN
guard, liveness (a dead or hung rank named) and preemption (signal → checkpoint → requeue)."""
