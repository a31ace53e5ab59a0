"""How ranks cooperate: the Accelerate/DeepSpeed set-up generated from the config (accelerator.py) and expert
parallelism (expert_parallel.py, with DeepSpeed's side of it in deepspeed_experts.py). Fully sharded data parallelism,
pipeline parallelism and the layout planner belong here too."""
