"""How the ranks of a run split its work and state: what each --layout holds (layouts), the target's layers in
pipeline stages and the drafter ranks they feed (pipeline, taps), and the sharded (DCP) checkpoints of the
layouts that shard the drafter's state (sharded_checkpoint)."""
