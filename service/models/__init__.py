"""Model artefacts: the bundled baseline and loading checkpoints into modules."""
