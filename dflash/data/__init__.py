"""Training data: chat conversations on disk, the assistant spans the drafter learns, data sources of any
size, the token cache shared by ranks, and length-bucketed batches."""
