"""Training a drafter: anchors and blocks, the step, losses, the schedule, checkpoints, the run directory,
what a run shows while it runs (monitor, trackers, MFU, evaluation) and the report it leaves."""
