"""Multi-GPU scaling of drafter training: the same command under torchrun on 1 and N processes, in one run.

    python bench/bench_scaling.py --nprocs 1,2 --presets 27b       (one host with 2+ GPUs: NCCL, one GPU a rank)
    python bench/bench_scaling.py --nprocs 1,2 --device cpu        (2 CPU processes on gloo: the plumbing only)

Throughput (weak scaling, the data-parallel case): each process trains on --per-rank-batch sequences per
micro-batch, so N processes take N times the global batch; every process runs its own frozen target and
DDP averages the drafter's gradients. Scaling efficiency = tokens/s on N / (N x tokens/s on 1).

Same loss: one process on the global batch of the largest N (batch N x per-rank, when it fits) against the
N-process run: dflash.train splits a global micro-batch round-robin over the ranks and normalises the loss
over the whole global batch, so the per-step losses must agree (float rounding on CPUs, bf16 noise on GPUs).

Every run is bench/bench_train.py's real training loop (`dflash.train.trainer.train`) launched by
`python -m torch.distributed.run --standalone`. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launch(nprocs: int, batch: int, args, out: Path) -> dict:
    """One torchrun launch of bench_train's loop; returns rank 0's row (or the error)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
           str(ROOT / "bench" / "bench_train.py"), "--presets", args.presets, "--attention", args.attention,
           "--device", args.device, "--batch-size", str(batch), "--no-split", "--json", str(out), *args.extra]
    env = {**os.environ, **NO_MULTICAST}
    if args.device == "cpu":
        env["OMP_NUM_THREADS"] = "1"
    print(f"+ {' '.join(cmd)}", flush=True)
    run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0 or not out.exists():
        tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
        return {"nprocs": nprocs, "batch": batch, "error": f"exit {run.returncode}: " + " | ".join(tail)}
    rows = json.loads(out.read_text())
    if not rows:
        return {"nprocs": nprocs, "batch": batch, "error": "bench_train reported no row"}
    loop = rows[0]["loop"]
    return {"nprocs": nprocs, "batch": batch, "tokens_per_s": loop["tokens_per_s"], "losses": loop["losses"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", default=None, help="comma list of process counts (default: 1 and every GPU)")
    p.add_argument("--per-rank-batch", type=int, default=2, help="sequences per process per micro-batch")
    p.add_argument("--presets", default="large", help="bench_train preset: demo, large, 27b")
    p.add_argument("--attention", default="auto", help="drafter attention: auto, sdpa, flex")
    p.add_argument("--device", default="auto", help="'auto' (GPUs if there), 'cpu' (gloo), 'cuda' (NCCL)")
    p.add_argument("--no-loss-check", action="store_true", help="skip the one-process run on the largest global batch")
    p.add_argument("--json", help="also write the results to this JSON file")
    args, extra = p.parse_known_args(argv)
    args.extra = extra  # passed through to bench_train (--steps, --seq-len, --hidden, ...)
    if args.nprocs is None:
        import torch

        gpus = torch.cuda.device_count() if args.device != "cpu" else 0
        args.nprocs = f"1,{gpus}" if gpus > 1 else "1,2"
    counts = sorted({int(n) for n in args.nprocs.split(",") if n.strip()})
    if counts[0] != 1:
        counts.insert(0, 1)

    results, check = [], None
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        for n in counts:
            results.append(launch(n, n * args.per_rank_batch, args, Path(tmp) / f"n{n}.json"))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
        biggest = results[-1]
        if not args.no_loss_check and biggest["nprocs"] > 1 and "error" not in biggest:
            check = launch(1, biggest["batch"], args, Path(tmp) / "check.json")

    base = results[0].get("tokens_per_s")
    lines = [f"{'procs':>5} {'global batch':>12} {'tokens/s':>10} {'per proc':>9} {'efficiency':>10}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['nprocs']:>5} {r['batch']:>12}  failed: {r['error'][:200]}")
            continue
        r["efficiency"] = r["tokens_per_s"] / (r["nprocs"] * base) if base else None
        eff = f"{r['efficiency']:.0%}" if r["efficiency"] else "-"
        lines.append(f"{r['nprocs']:>5} {r['batch']:>12} {r['tokens_per_s']:>10.0f} "
                     f"{r['tokens_per_s'] / r['nprocs']:>9.0f} {eff:>10}")
    if check is not None:
        if "error" in check:
            lines.append(f"loss check: one process on batch {check['batch']} failed: {check['error'][:200]}")
        else:
            worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(check["losses"], biggest["losses"]))
            check["max_rel_loss_diff"] = worst
            lines.append(f"loss check: {biggest['nprocs']} processes vs one on the same global batch "
                         f"({biggest['batch']} sequences), {len(check['losses'])} steps: "
                         f"max relative difference {worst:.1e}")
    print("\n" + "\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "loss_check": check}, indent=2) + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
