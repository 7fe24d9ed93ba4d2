"""The errors of the `dflash`, `dflash-train` and `dflash-eval` programs, one class per failure, each
with its own exit code (as wheelbuilder/errors.py does for the build side).

Messages say what failed, the values seen, and what to do next. DflashError derives from the project's
one error base (common.errors.FatalError), so the command lines (`dflash.cli`, under common.cli.run_cli)
catch it, print its message and exit with its code; everything below them only raises, so tests call
the functions directly. Each class also keeps the built-in base it has always had (ValueError,
RuntimeError), so callers that catch those still do.

    1  DflashError      (base; also `dflash-eval` when the output was not lossless)
    2  ConfigError      a bad option, or options that contradict each other
    3  CheckpointError  a checkpoint cannot be written, or does not fit the run resuming it
    4  TrainError       training cannot go on (out of memory, no usable sample)
    5  TargetError      the target model cannot be loaded or tapped as asked
    6  DataError        the training data cannot be read or tokenised
    7  DrafterError     a drafter directory cannot be read, or does not fit the target
    8  ServerError      an inference server failed requests after every retry (`dflash regenerate --endpoint`)
    9  ChatTemplateError the target's chat template gives no way to locate assistant turns (a DataError)
   10  RunDirBusy       another dflash-train run holds the lock on the same --out (also a common BusyError)
   11  RankLostError    another process of a multi-process run went away (crash, kill, OOM killer) mid-run
"""

from __future__ import annotations

from common.errors import BusyError, FatalError


class DflashError(FatalError):
    """A failure that stops a dflash command; `str()` is the full, user-facing message."""

    exit_code = 1


class ConfigError(DflashError, ValueError):
    """An option has a bad value or options contradict each other; the message says which and the fix."""

    exit_code = 2


class CheckpointError(DflashError, RuntimeError):
    """A checkpoint cannot be written or does not fit this run; the message says why and what to do."""

    exit_code = 3


class TrainError(DflashError, RuntimeError):
    """Training cannot go on (out of memory, no usable data); the message names the knob to turn."""

    exit_code = 4


class TargetError(DflashError, ValueError):
    """The target cannot be loaded or used as asked (no config.json, bad layer ids, no mask token)."""

    exit_code = 5


class DataError(DflashError, ValueError):
    """Bad training data; the message names the file, line or sample and says how to fix it."""

    exit_code = 6


class DrafterError(DflashError, ValueError):
    """A drafter directory cannot be read or does not fit the target; the message names each mismatch."""

    exit_code = 7


class ServerError(DflashError, RuntimeError):
    """An inference server failed requests after every retry; the message gives how many, the reasons and
    where each failure is recorded."""

    exit_code = 8


class ChatTemplateError(DataError):
    """The chat template gives no way to locate assistant turns (no generation prompt, no end-of-turn
    marker, turns not starting with the generation prompt); the message names the template."""

    exit_code = 9


class RunDirBusy(DflashError, BusyError):
    """Another run holds the lock on the same run directory (--out); the message names the holder's pid.
    Code 10, not common.errors' 7: 7 is DrafterError in this family."""

    exit_code = 10


class RankLostError(TrainError):
    """Another process of a multi-process run went away in the middle of a collective; the surviving
    ranks stop with this (the message names this rank, the step and the last checkpoint)."""

    exit_code = 11


# Refusals every rank of a multi-process run finds the same way (they check the same options and files):
# rank 0 says them, the other ranks exit with the code quietly (dflash.cli, dflash.train.trainer).
SAID_BY_RANK_0 = (ConfigError, CheckpointError, DataError, DrafterError, TargetError, RunDirBusy)
