"""The kernel doctor and the image's health check (docs/architecture.md, "The doctor").

    doctor.py      `dflash doctor`: runs the checks in order, prints the table or JSON, saves the verdict
    checks.py      the checks that need no GPU: versions, import, arch coverage, dispatch, C compiler
    numerics.py    float64 references and the GPU numerics check of the GatedDeltaNet kernels
    triton_jit.py  the smallest proof that Triton can JIT-compile and run a kernel here
    ipc.py         shared memory (/dev/shm) and loopback: what multi-process work needs from the container
    verdict.py     CheckResult, Report: the verdict as a table or as JSON (schema 1), saved atomically
    healthcheck.py `dflash healthcheck`: the saved verdict plus the trainer's heartbeat
                   (dflash/train/records/heartbeat.py) decide the exit code
    entrypoint.py  `dflash entrypoint`: the image's entrypoint (background doctor, then the command)

Importing this package imports nothing heavy: the health check runs every 30 s and must stay cheap.
"""
