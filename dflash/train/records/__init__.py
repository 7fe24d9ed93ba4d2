"""What a run writes and reads back: its directory (rundir), checkpoints and their manifests (checkpoint,
manifest), the live view of the run (monitor, trackers, heartbeat) and the reports left afterwards (run_report,
run_compare)."""
