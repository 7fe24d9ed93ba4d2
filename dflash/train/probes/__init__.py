"""What benchmarks and tests measure a run with: model FLOPs utilisation (mfu), device clocks and the matmul
peak (timing), synthetic batches of a fixed shape (synthetic), and a step's gradients against an fp32 step
(step_numerics)."""
