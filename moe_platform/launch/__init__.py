"""The commands a user types: `moe-train` (cli.py) and `moe-submit` (submit.py), the one-sentence reports of bad
input (bad_input.py) and the memory gate that refuses a run the machine cannot hold (memory.py). Only this wing
composes configs with Hydra; nothing else in the runtime imports it."""
