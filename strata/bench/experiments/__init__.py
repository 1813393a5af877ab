"""The reference write-up's experiments as commands: ``strata experiment NAME`` (docs/EXPERIMENTS.md)."""
