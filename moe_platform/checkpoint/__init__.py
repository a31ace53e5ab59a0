"""Checkpoints on disk: written complete or not at all, found, verified and resumed at any layout they support.
Imports no other wing: the trainer hands it what to save."""
