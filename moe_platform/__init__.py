"""moe_platform: the runtime — entry point, config schema, trainer, checkpoints, logging, launch.

Depends on `moe` and `data_pipeline`, never the other way round. Named `moe_platform` (not `platform`) because a
top-level package called `platform` would shadow the standard library module that torch imports.
"""
