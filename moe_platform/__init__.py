"""moe_platform: the runtime that trains `moe` models on `data_pipeline` batches, grouped in wings by concern.

    launch/      the commands a user types (moe-train, moe-submit), bad-input reporting, the memory gate
    train/       the trainer and what guards its loop: model build, seeding, NaN guard, liveness, preemption
    checkpoint/  checkpoints on disk: save/resume, manifest, layout, expert shards, universal copies, consolidation
    parallel/    process groups and strategies: Accelerate/DeepSpeed set-up, expert parallelism
    monitor/     what a run reports: metrics and dashboards, routing alerts, throughput, peak memory, progress,
                 the HTML report (moe-report)
    interop/     models in and out: Hugging Face conversion, init-from, upcycling, moe-export
At the root: the config schema (`config.py`) and what every wing stands on (`redact.py`, `faults.py`), and the
tests' kit (`testing.py`). `tests/test_architecture.py` holds the arrows allowed between wings.

Depends on `moe` and `data_pipeline`, never the other way round. Named `moe_platform` (not `platform`) because a
top-level package called `platform` would shadow the standard library module that torch imports.
"""
