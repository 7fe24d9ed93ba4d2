"""Tokenised training data, built once per (data, tokenizer, max length, span rules) and shared by ranks.

    --data --datasets_io--> raw records --map(num_proc): parse + dflash.data.spans--> {input_ids, loss_mask}
      --> <cache>/<key>/train (+ eval), record.json        (Arrow files, memory-mapped when read)

The key hashes the data's content (every file's bytes, not its path or mtime), the tokenizer (its
vocabulary and merges, special tokens and chat template), --max-length, the minimum of supervised
tokens a sample needs (2 x --block-size), SPAN_RULES_VERSION and the evaluation split's inputs. So a
second run with the same inputs starts training without tokenising anything, and a cache written by
another tokenizer (another chat template included) is never reused: its key differs, it is rebuilt.

A build writes into a temporary directory beside the final one (".<key>.tmp-<host>-<pid>-<random>") and
renames it when complete, so a crashed build leaves no half cache: an error (a full disk included:
dflash.data.cache_space names the space it needs), Ctrl-C or SIGTERM removes it on the way out, and one
left by a process killed outright (SIGKILL, an abort, a power cut) is removed by the next build on the same
host, once its process is gone. A record too long for --max-length
(dflash.data.sources.max_record_bytes) is never tokenised: it is counted ("too_long"), or fatal with
--on-bad-line stop. Under torchrun, rank 0 builds (or finds) the cache while the other
ranks wait on a barrier (the process group's timeout: 30 min), then every rank reads the same files;
the cache directory must therefore be visible to all ranks (shared storage across nodes).

Where the cache lives: --data-cache, else $DFLASH_CACHE/tokenized, else "tokenized-cache" beside the
run's --out directory.

Evaluation split: --eval-data (tokenised the same way, stored beside as eval/) or --eval-fraction F (a
seeded share of the kept samples held out). `TokenizedItems.eval` holds it; None without one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from dflash import distributed
from dflash.data import cache_space
from dflash.data.chat import CONVERSATION_RULES_VERSION, DataReport, bad_record_reason, parse_conversation
from dflash.data.sources import content_fingerprint, find_source, max_record_bytes, read_records
from dflash.errors import DataError, TrainError
from dflash.data.spans import SPAN_RULES_VERSION, Unusable

log = logging.getLogger(__name__)

FORMAT = "dflash-tokenized/1"


class TokenizedItems:
    """A read-only sequence of {"input_ids": LongTensor[T], "loss_mask": LongTensor[T]} backed by Arrow
    files; `lengths` [N] ints, `fingerprint` (the cache key), `report` (DataReport), `eval` (or None)."""

    def __init__(self, dataset, fingerprint: str, report: DataReport, eval_items: "TokenizedItems | None" = None):
        self._data = dataset
        self.lengths: list[int] = list(dataset["length"])
        self.fingerprint = fingerprint
        self.report = report
        self.eval = eval_items

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self._data[int(i)]
        return {"input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
                "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long)}

    def __iter__(self):
        return (self[i] for i in range(len(self)))


# --------------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------------
def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what decides the token ids and the mask: the vocabulary/merges, the special tokens and
    the chat template (a fine-tune that only changes its template gets another cache)."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # truncation/padding: call-time state that tokenizer(...) itself changes
        spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
    else:
        spec = tokenizer.get_vocab()
    h.update(json.dumps(spec, sort_keys=True).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(json.dumps(tokenizer.chat_template, sort_keys=True).encode())
    return h.hexdigest()


def cache_inputs(config, tokenizer) -> dict:
    """Everything the tokenised data depends on (hashed into the key; written to record.json)."""
    inputs = {
        "format": FORMAT, "span_rules": SPAN_RULES_VERSION, "conversation_rules": CONVERSATION_RULES_VERSION,
        "max_record_bytes": max_record_bytes(config.model.max_length),
        "data": content_fingerprint(find_source(config.io.data)),
        "eval_data": content_fingerprint(find_source(config.watch.eval_data)) if config.watch.eval_data else None,
        "eval_fraction": config.watch.eval_fraction, "seed": config.optim.seed if config.watch.eval_fraction else None,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "max_length": config.model.max_length, "min_supervised": 2 * config.model.block_size,
        "on_bad_line": config.io.on_bad_line,
    }
    return inputs


def cache_root(config) -> Path:
    if config.io.data_cache:
        return Path(config.io.data_cache)
    if os.environ.get("DFLASH_CACHE"):
        return Path(os.environ["DFLASH_CACHE"]) / "tokenized"
    return Path(config.io.out).resolve().parent / "tokenized-cache"


def default_num_proc(n_records: int, asked: int) -> int:
    """--num-proc, or (0) one process per available core, but no more than one per 2,000 records."""
    if asked > 0:
        return asked
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, n_records // 2000))


# --------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------
def _tokenize_batch(batch, *, tokenizer, max_length: int, min_supervised: int, stop_on_bad: bool):
    """Datasets.map function: raw records -> input_ids, loss_mask, length, drop reason and detail."""
    from dflash.data import spans

    out = {"input_ids": [], "loss_mask": [], "length": [], "drop": [], "detail": []}

    def dropped(reason, detail):
        for key, value in (("input_ids", []), ("loss_mask", []), ("length", 0), ("drop", reason), ("detail", detail)):
            out[key].append(value)

    for raw, where, error in zip(batch["raw"], batch["where"], batch["error"]):
        if error:
            reason = error.split(":", 1)[0]
            if stop_on_bad:
                raise DataError(f"{where}: {error}; fix or delete that record, or pass --on-bad-line skip")
            dropped(reason, f"{where}: {error}")
            continue
        try:
            messages = parse_conversation(json.loads(raw))
        except ValueError as exc:
            reason = bad_record_reason(exc)
            if stop_on_bad:
                raise DataError(f"{where}: {exc}; fix or delete that record, or pass --on-bad-line skip") from None
            dropped(reason, f"{where}: {exc}")
            continue
        try:
            ids, mask = spans.tokenize_conversation(tokenizer, messages, max_length)
        except Unusable as exc:
            dropped(exc.reason, f"{where}: {exc}")
            continue
        if sum(mask) < min_supervised:
            dropped("too_few_supervised_tokens", f"{where}: {sum(mask)} supervised tokens < {min_supervised}")
            continue
        for key, value in (("input_ids", ids), ("loss_mask", mask), ("length", len(ids)), ("drop", ""), ("detail", "")):
            out[key].append(value)
    return out


def tokenize_source(path, tokenizer, *, max_length: int, min_supervised: int, work_dir: Path,
                    num_proc: int = 0, on_bad_line: str = "skip", progress: bool = True):
    """Read and tokenise one --data/--eval-data source: (Dataset of kept samples, DataReport)."""
    import datasets

    source = find_source(path)
    bars_were_off = datasets.utils.are_progress_bars_disabled()
    if not progress:
        datasets.utils.disable_progress_bars()
    try:
        return _tokenize_source(source, tokenizer, max_length=max_length, min_supervised=min_supervised,
                                work_dir=work_dir, num_proc=num_proc, on_bad_line=on_bad_line)
    finally:
        if not progress and not bars_were_off:
            datasets.utils.enable_progress_bars()


def _tokenize_source(source, tokenizer, *, max_length, min_supervised, work_dir, num_proc, on_bad_line):
    from datasets import Features, Sequence, Value

    records = read_records(source, work_dir, num_proc=max(1, num_proc), max_length=max_length)
    procs = default_num_proc(len(records), num_proc)
    features = Features({"input_ids": Sequence(Value("int32")), "loss_mask": Sequence(Value("int8")),
                         "length": Value("int32"), "drop": Value("string"), "detail": Value("string")})
    done = records.map(
        _tokenize_batch, batched=True, batch_size=256, remove_columns=records.column_names, features=features,
        fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length, min_supervised=min_supervised,
                       stop_on_bad=on_bad_line == "stop"),
        num_proc=procs if procs > 1 else None, desc=f"tokenise ({procs} proc)",
        cache_file_name=str(work_dir / "tokenized.arrow"), new_fingerprint=hashlib.sha256(
            str(work_dir).encode()).hexdigest()[:16])
    report = DataReport(source=str(source.path))
    drops = done["drop"]
    report.n_read = len(drops)
    report.skipped = Counter(d for d in drops if d)
    report.n_kept = report.n_read - report.n_skipped
    report.examples = [d for d in done.select(_first_drops(drops, report.max_examples))["detail"]]
    kept = done.filter(lambda d: not d, input_columns="drop", num_proc=procs if procs > 1 else None,
                       cache_file_name=str(work_dir / "kept.arrow"))
    return kept.remove_columns(["drop", "detail"]), report


def _first_drops(drops: list[str], n: int) -> list[int]:
    return [i for i, d in enumerate(drops) if d][:n]


_STALE = re.compile(r"\.(?P<key>[0-9a-f]+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+")


def _build_prefix(final: Path) -> str:
    """The name a build's temporary directory starts with: the key, this host and this process."""
    return f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_builds(root: Path) -> list[Path]:
    """Remove the temporary build directories in `root` that a process of this host left when it was killed
    (its pid is gone, or is this process: a restarted container reuses pids); returns them. Builds of other
    hosts (shared storage) are left alone: whether they still run cannot be told from here."""
    host, removed = socket.gethostname(), []
    for path in root.glob(".*.tmp-*") if root.is_dir() else []:
        m = _STALE.fullmatch(path.name)
        if not m or m["host"] != host or not path.is_dir():
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def build(config, tokenizer, final: Path, inputs: dict) -> None:
    """Tokenise --data (and the eval split) into `final`, via a temporary directory renamed at the end
    (removed on any error, Ctrl-C or SIGTERM; after a kill, by the next build: remove_stale_builds)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_build_prefix(final), dir=final.parent))
    try:
        kw = dict(max_length=config.model.max_length, min_supervised=2 * config.model.block_size,
                  num_proc=config.io.num_proc, on_bad_line=config.io.on_bad_line, progress=config.runtime.progress)
        train, report = tokenize_source(config.io.data, tokenizer, work_dir=tmp / "work-train", **kw)
        record = {"inputs": inputs, "report": report.to_dict()}
        if config.watch.eval_data:
            evals, eval_report = tokenize_source(config.watch.eval_data, tokenizer, work_dir=tmp / "work-eval", **kw)
            record["eval_report"] = eval_report.to_dict()
        elif config.watch.eval_fraction:
            order = list(range(len(train)))
            random.Random(config.optim.seed).shuffle(order)
            n_eval = max(1, round(config.watch.eval_fraction * len(order)))
            if n_eval >= len(order):
                raise DataError(f"--eval-fraction {config.watch.eval_fraction} of {len(order)} usable samples leaves "
                                "none to train on; lower it or add data")
            evals, train = train.select(sorted(order[:n_eval])), train.select(sorted(order[n_eval:]))
        else:
            evals = None
        train.save_to_disk(str(tmp / "train"))
        if evals is not None:
            evals.save_to_disk(str(tmp / "eval"))
        record.update(n_train=len(train), n_eval=0 if evals is None else len(evals))
        (tmp / "record.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        for work in tmp.glob("work-*"):
            shutil.rmtree(work)
        try:
            os.replace(tmp, final)
        except OSError:  # another builder (another node on shared storage) finished first: keep its copy
            if not (final / "record.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def _report(data: dict) -> DataReport:
    report = DataReport(source=data["source"], n_read=data["n_read"], n_kept=data["n_kept"])
    report.skipped.update(data["skipped"])
    report.examples = list(data["examples"])
    return report


def open_cache(final: Path, key: str) -> TokenizedItems:
    from datasets import load_from_disk

    record = json.loads((final / "record.json").read_text())
    evals = None
    if (final / "eval").is_dir():
        evals = TokenizedItems(load_from_disk(str(final / "eval")), key + "-eval",
                               _report(record.get("eval_report", record["report"])))
    return TokenizedItems(load_from_disk(str(final / "train")), key, _report(record["report"]), evals)


def _rank() -> tuple[int, int]:
    """(rank, world size) of this process: torchrun's process group when there is one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def load_tokenized(config, tokenizer) -> TokenizedItems:
    """The run's TokenizedItems: read from the cache, or built there first (rank 0 builds, others wait)."""
    rank, world_size = _rank()
    d = distributed.Dist(rank=rank, world_size=world_size, local_rank=0, device=torch.device("cpu"))
    inputs = cache_inputs(config, tokenizer)
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
    final = cache_root(config) / key
    if d.is_main:
        for stale in remove_stale_builds(final.parent):
            log.warning("removed %s: a partial tokenised cache left by a run that was killed", stale)
        if (final / "record.json").is_file():
            log.info("tokenised data from the cache %s", final)
        else:
            start = time.perf_counter()
            log.info("tokenising %s into %s", config.io.data, final)
            before = cache_space.room(final.parent)
            try:
                build(config, tokenizer, final, inputs)
            except Exception as exc:  # a full disk: say where, how much and what to do (no traceback)
                if (full := cache_space.full_disk_cause(exc)) is None:
                    raise
                raise cache_space.full_disk_error(full, final, config, tokenizer, before) from None
            log.info("tokenised in %.1f s", time.perf_counter() - start)
    distributed.barrier(d)
    if not (final / "record.json").is_file():
        raise DataError(f"rank {d.rank}: the tokenised data {final} written by rank 0 is not visible here; "
                        "put --data-cache on storage every node can read")
    items = open_cache(final, key)
    log.info("%s", items.report.summary())
    if items.report.n_skipped:
        log.warning("first problems: %s", "; ".join(items.report.examples))
    if not len(items):
        raise TrainError(f"no usable training sample ({items.report}); each needs at least 2 x --block-size "
                         "supervised (assistant) tokens. Check --data and --max-length.")
    return items
