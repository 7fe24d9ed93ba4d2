"""Room for the tokenised cache: what a build needs on its disk, and the error when that disk fills mid-build.

A build (dflash.data.token_cache.build) holds at its peak, in its temporary directory:

    records          the data's records as raw JSON text (about the data's own size), each with its "where"
    tokenised        every record's input_ids (int32) and loss_mask (int8): 5 bytes a token, plus offsets,
                     a length and the drop reason per record
    train (+ eval)   the kept samples saved again: 5 bytes a token, plus offsets and a length per record

The tokens are estimated from the data's first records, tokenised as the build tokenises them (tokens per
byte of data), and scaled to the whole data; a byte-level tokenizer has about 4 times the tokens of a BPE one.
Measured on the project's chat fixtures (600 and 2,000 conversations, --max-length 96 and 512, on tmpfs
filesystems of growing size), the build's real peak lay between 0.65 and 1.01 times this estimate.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from dflash.errors import TrainError

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})  # the disk (or the user's quota) has no room left
SAMPLE = 256  # records tokenised for the estimate
TOKEN_BYTES = 5  # int32 id + int8 mask
RECORD_BYTES = 48  # per record and copy: list offsets, the length, the drop reason and its detail (empty)


def full_disk_cause(exc: BaseException) -> OSError | None:
    """The "no space left" (or quota) error underneath `exc`: datasets wraps what pyarrow's writer raised."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def data_bytes(source) -> int:
    return sum(p.stat().st_size for p in source.shards)


def needed_bytes(config, tokenizer) -> tuple[int, int]:
    """(bytes a build of --data (and --eval-data) needs at its peak, tokens it is estimated to hold)."""
    from dflash.data.sources import find_source

    need = tokens = 0
    for path in filter(None, (config.io.data, config.watch.eval_data)):
        source = find_source(path)
        size, (per_byte, records_per_byte, where) = data_bytes(source), _measure(source, config, tokenizer)
        n_tokens, n_records = round(size * per_byte), round(size * records_per_byte)
        need += size + n_records * (where + 3 * RECORD_BYTES) + n_tokens * 2 * TOKEN_BYTES
        tokens += n_tokens
    return int(need) + (256 << 10), tokens  # + the datasets' own JSON files and record.json


def _measure(source, config, tokenizer) -> tuple[float, float, float]:
    """(tokens, records per byte of data; the mean size of a record's "where") on the first SAMPLE records."""
    from dflash.data.sources import first_records
    from dflash.data.token_cache import _tokenize_batch

    raws = first_records(source, SAMPLE, config.model.max_length)
    if not raws:
        return 1.0, 0.0, 0.0
    where = [f"{source.shards[0]}:{i + 1}" for i in range(len(raws))]
    out = _tokenize_batch({"raw": raws, "where": where, "error": [""] * len(raws)}, tokenizer=tokenizer,
                          max_length=config.model.max_length, min_supervised=2 * config.model.block_size,
                          stop_on_bad=False)
    sampled = sum(len(r.encode("utf-8", "surrogatepass")) + 1 for r in raws)  # + its line's end
    return sum(out["length"]) / sampled, len(raws) / sampled, sum(map(len, where)) / len(raws)


def size_text(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def room(root: Path) -> tuple[int, int]:
    """(free, total) bytes of the filesystem that holds (or will hold) `root`. Taken before a build: the
    files a failed build removed stay allocated while this process still maps them."""
    while not root.exists() and root != root.parent:
        root = root.parent
    usage = shutil.disk_usage(root)
    return usage.free, usage.total


def full_disk_error(exc: OSError, final: Path, config, tokenizer, before: tuple[int, int]) -> TrainError:
    """The error of a build of `final` that ran out of space; `before`: room() as the build began."""
    need, tokens = needed_bytes(config, tokenizer)
    return TrainError(
        f"the tokenised data cache {final.parent} ran out of space while it was built ({exc.strerror or exc}). "
        f"Building it needs about {size_text(need)} there (this data: about {tokens:,} tokens); that disk had "
        f"{size_text(before[0])} free of {size_text(before[1])} when the build began. Nothing of the build was "
        "kept. Free space there, or put the cache on a disk with room (--data-cache DIR, or DFLASH_CACHE), then "
        "run again.")
