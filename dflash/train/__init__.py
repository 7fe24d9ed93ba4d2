"""Training a drafter. The run itself lives here: its set-up and the checks before any weight loads
(trainer, multi, setup, precheck), the one training loop and each drafter's lane in it (loop, lane), the
blocks and what one micro-batch computes (blocks, step; the micro-batches are dflash.batching's), the schedule, the evaluation split, and
how a run stops (signals, faults). Three sub-packages hold one job each: parallel (what each rank holds),
records (what a run writes and reads back) and probes (what benchmarks and tests measure with). The
objectives are dflash.objective's."""
