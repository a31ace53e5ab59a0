"""Models in and out: Hugging Face conversion, a fresh run's initial weights (init_from.py), sparse upcycling, and
`moe-export` (export.py). Reads checkpoints; never imports the trainer."""
