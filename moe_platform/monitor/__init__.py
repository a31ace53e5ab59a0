"""What a run reports: metric records and their sinks (metrics.py; dashboards.py decides what reaches wandb and
TensorBoard), routing alerts, throughput and MFU, peak memory beside the ledger, the progress bar, and the HTML
report of a run directory (report.py, `moe-report`). Imports no other wing."""
