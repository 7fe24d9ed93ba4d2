"""GPU memory by phase of the training loop, and what holds it when a step runs out of memory.

    phases = PhaseMemory(device, steps=3, snapshot=False).install(target)    before dflash.train.trainer.train
    phases.summary()                                                        a row's "memory_phases" entry

Each of the first `steps` micro-batches records, at the end of each phase, the memory the caching allocator
hands out (torch.cuda.memory_allocated) and the step's peak so far (max_memory_allocated: the trainer resets it
at every step, so the first phase after which it stops growing is the phase that set the step's peak):

    start             before the micro-batch: weights, gradients, optimizer state
    target forward    target.context: the tapped states [B, T, k*H] stay
    drafter forward   the drafter, LM head and loss forward (micro_batch_sums): what backward will need
    backward          the drafter's backward (step.backward)
    optimizer         clip + AdamW (Lane._apply_step)

On an out-of-memory error the phase it struck in, the allocator's message and (with `snapshot`, which records
every allocation's Python stack from the start: slower, for a diagnosis run only) the live blocks grouped by
the innermost frame of this repository's code that allocated them, largest first.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from pathlib import Path

import torch

GIB = 2 ** 30
REPO = str(Path(__file__).resolve().parents[1])


class PhaseMemory:
    def __init__(self, device: torch.device, steps: int = 3, snapshot: bool = False, top: int = 25):
        self.device, self.steps, self.snapshot, self.top = device, steps, snapshot, top
        self.records: list[list[list]] = []  # per micro-batch: [phase, allocated GiB, step peak so far GiB]
        self.oom: dict | None = None

    def _note(self, phase: str) -> None:
        if self.records and len(self.records) <= self.steps:
            self.records[-1].append([phase, round(torch.cuda.memory_allocated(self.device) / GIB, 3),
                                     round(torch.cuda.max_memory_allocated(self.device) / GIB, 3)])

    def _wrap(self, fn, phase: str, opens: bool = False):
        @functools.wraps(fn)
        def run(*a, **k):
            if opens:
                self.records.append([])
                self._note("start")
            try:
                out = fn(*a, **k)
            except torch.OutOfMemoryError as exc:
                if self.oom is None:  # the innermost phase records it; the outer ones see the same error
                    self.oom = self._out_of_memory(phase, exc)
                raise
            self._note(phase)
            return out
        return run

    def install(self, target) -> "PhaseMemory":
        """Wrap the loop's phase functions (module attributes dflash.train.lane looks up at call time)."""
        import dflash.train.lane as lane

        target.context = self._wrap(target.context, "target forward")
        lane.micro_batch_sums = self._wrap(lane.micro_batch_sums, "drafter forward", opens=True)
        lane.backward = self._wrap(lane.backward, "backward")
        lane.Lane._apply_step = self._wrap(lane.Lane._apply_step, "optimizer")
        if self.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        return self

    def _out_of_memory(self, phase: str, exc: BaseException) -> dict:
        info = {"phase": phase, "allocated_gib": round(torch.cuda.memory_allocated(self.device) / GIB, 3),
                "step_peak_gib": round(torch.cuda.max_memory_allocated(self.device) / GIB, 3),
                "message": str(exc)[:600]}
        if self.snapshot:
            info["holders"] = holders(torch.cuda.memory._snapshot(), self.top)
        return info

    def summary(self) -> dict:
        out = {"memory_phases": self.records[:self.steps]}
        if self.oom:
            out["out_of_memory"] = self.oom
        return out


def _where(frames: list[dict]) -> str:
    """The innermost frame of this repository's code (else the innermost frame), as path:line function."""
    mine = [f for f in frames if f.get("filename", "").startswith(REPO)]
    f = (mine or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{f['filename'].replace(REPO + '/', '')}:{f['line']} {f['name']}"


def holders(snapshot: dict, top: int = 25) -> list[list]:
    """[GiB, blocks, where] of the live (allocated) blocks of a memory snapshot, grouped by _where."""
    sizes, counts = defaultdict(int), defaultdict(int)
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or (block.get("history") or [{}])[0].get("frames", [])
            key = _where(frames)
            sizes[key] += block["size"]
            counts[key] += 1
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return [[round(size / GIB, 3), counts[key], key] for key, size in ranked]
