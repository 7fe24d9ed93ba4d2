"""Training conversations of any size, read into Arrow files: JSONL, JSON, Parquet, a directory of such
shards, or a dataset saved with `datasets` (`Dataset.save_to_disk`).

    --data PATH --find_source--> Source(kind, shards) --read_records--> Dataset {"raw": one record as
    JSON text, "where": "file:line" or "file#row", "error": why the record could not be read, or ""}

Records stay raw JSON text here, so that rows of any shape survive (Arrow would unify the messages of
all rows into one struct type); dflash.data.token_cache parses and tokenises them in parallel. A shard that
cannot be read raises DataError naming it; a line that is not JSON or not UTF-8 becomes a record whose
"error" says so (counted, or fatal with --on-bad-line stop). So does a record longer than
`max_record_bytes(max_length)`: only its first --max-length tokens could be trained on, and tokenising a
200 MB conversation exhausts the tokenizer's memory, so it is never read whole (a JSONL line is skipped
in blocks). A UTF-8 byte order mark at the start of a file is not part of its first record. Data with no
record at all is a DataError.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from dflash.data.chat import _MESSAGE_KEYS
from dflash.errors import DataError

SHARD_KINDS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
BOM = b"\xef\xbb\xbf"

# The most bytes of record (its JSON text) per token of --max-length: 32 bytes per token is more than any
# text needs (English takes about 4 in UTF-8, JSON-escaped CJK about 9), times 4. A longer record would give
# at most its first --max-length tokens, and tokenising it whole can exhaust memory.
RECORD_BYTES_PER_TOKEN = 128


def max_record_bytes(max_length: int) -> int:
    """The longest record (bytes of its JSON text) read for a run with this --max-length."""
    return max(1, int(max_length)) * RECORD_BYTES_PER_TOKEN


def too_long(n_bytes: int, max_length: int) -> str:
    """The "error" of a record of `n_bytes` bytes beyond max_record_bytes(max_length)."""
    return (f"too_long: the record is {n_bytes:,} bytes, more than {max_record_bytes(max_length):,} (--max-length "
            f"{max_length} x {RECORD_BYTES_PER_TOKEN} bytes per token): training would keep only its first "
            f"{max_length} tokens, and tokenising all of it can exhaust memory. Split it into shorter "
            "conversations, or raise --max-length")


def _text_bytes(text: str, limit: int) -> int:
    """The UTF-8 size of `text`, computed only when its length in characters does not settle `limit`."""
    if len(text) > limit or 4 * len(text) <= limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class Source:
    """What --data names: `kind` is "shards" (JSONL/JSON/Parquet files) or "saved" (a saved dataset)."""

    path: Path
    kind: str
    shards: tuple[Path, ...]


def find_source(path) -> Source:
    """The files behind --data; a directory holds shards (searched recursively) or a saved dataset."""
    path = Path(path)
    if path.is_file():
        if path.suffix not in SHARD_KINDS:
            raise DataError(f"{path}: unknown data format {path.suffix!r}; use .jsonl, .json or .parquet files, "
                            "a directory of them, or a dataset saved with datasets' save_to_disk")
        return Source(path, "shards", (path,))
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return Source(path, "saved", tuple(sorted(p for p in path.rglob("*") if p.is_file())))
        shards = tuple(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SHARD_KINDS))
        if not shards:
            raise DataError(f"{path}: no .jsonl, .json or .parquet shard in this directory (and no saved "
                            "dataset: dataset_info.json is missing); point --data at the data files")
        return Source(path, "shards", shards)
    raise DataError(f"{path}: no such file or directory; pass a JSONL/JSON/Parquet file, a directory of "
                    "them, or a saved dataset")


def content_fingerprint(source: Source) -> str:
    """sha256 over every file's bytes (and, in a directory, its relative name): the same data under
    another path or file name matches."""
    h = hashlib.sha256(source.kind.encode())
    for shard in source.shards:
        h.update(str(shard.relative_to(source.path) if shard != source.path else "").encode() + b"\0")
        try:
            with shard.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
        except OSError as exc:
            raise DataError(f"{shard}: cannot be read ({exc}); fix its permissions or remove it from "
                            f"{source.path}") from None
        h.update(b"\1")
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------------
def _conversation_column(names, where) -> str:
    column = next((c for c in _MESSAGE_KEYS if c in names), None)
    if column is None:
        raise DataError(f"{where}: no conversation column (columns: {', '.join(sorted(names)[:12])}); "
                        f"the conversations must be in a column named one of {', '.join(_MESSAGE_KEYS)}, "
                        "holding lists of {role, content} messages")
    return column


def _lines(fh, limit: int):
    """(line number, the line's bytes, or None when it is longer than `limit`, its size) of a binary file;
    a longer line is skipped in blocks, never held whole."""
    lineno = 0
    while True:
        raw = fh.readline(limit + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield lineno, raw, len(raw)
            continue
        size = len(raw)
        while not raw.endswith(b"\n"):
            raw = fh.readline(1 << 20)
            if not raw:
                break
            size += len(raw)
        yield lineno, None, size


def _jsonl_records(shard: Path, max_length: int):
    limit = max_record_bytes(max_length)
    with shard.open("rb") as lines:
        for lineno, raw, size in _lines(lines, limit + 2):  # + 2: room for the line's end, "\r\n"
            where = f"{shard}:{lineno}"
            raw = raw.rstrip(b"\r\n") if raw is not None else None  # the record is the line without its end
            if raw is None or len(raw) > limit:
                yield {"raw": "", "where": where, "error": too_long(len(raw) if raw is not None else size, max_length)}
                continue
            if lineno == 1:  # a UTF-8 byte order mark (Windows editors) is not part of the first record
                raw = raw.removeprefix(BOM)
            if not raw.strip():
                continue
            try:
                yield {"raw": raw.decode("utf-8"), "where": where, "error": ""}
            except UnicodeDecodeError as exc:
                yield {"raw": "", "where": where, "error": f"not_utf8: {exc}"}


def _checked(raw: str, where: str, max_length: int) -> dict:
    """A record read whole (a JSON or Parquet row): refused when longer than max_record_bytes(max_length)."""
    limit = max_record_bytes(max_length)
    size = _text_bytes(raw, limit)
    if size > limit:
        return {"raw": "", "where": where, "error": too_long(size, max_length)}
    return {"raw": raw, "where": where, "error": ""}


def _json_records(shard: Path, max_length: int):
    try:
        data = json.loads(shard.read_bytes().decode("utf-8-sig"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{shard}: not a JSON document ({exc}); a .json shard holds one list of records "
                        "(use .jsonl for one record per line)") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{shard}: the JSON document is a {type(data).__name__}; it must be a list of "
                        'conversation records (or {"data": [...]})')
    for i, record in enumerate(data):
        yield _checked(json.dumps(record, ensure_ascii=False), f"{shard}#{i}", max_length)


def _parquet_records(shard: Path, max_length: int):
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(shard)
        column = _conversation_column(file.schema_arrow.names, shard)
        columns = [column] + (["tools"] if "tools" in file.schema_arrow.names else [])
        row = 0
        for batch in file.iter_batches(columns=columns, batch_size=1024):
            for value in batch.to_pylist():
                record = {"messages": value[column], **({"tools": value["tools"]} if "tools" in value else {})}
                yield _checked(json.dumps(record, ensure_ascii=False, default=str), f"{shard}#{row}", max_length)
                row += 1
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DataError(f"{shard}: cannot be read as Parquet ({type(exc).__name__}: {exc}); "
                        "re-export it or remove it from the data") from None


def _shard_records(shards: list[str], max_length: int):
    readers = {"jsonl": _jsonl_records, "json": _json_records, "parquet": _parquet_records}
    for name in shards:
        shard = Path(name)
        try:
            yield from readers[SHARD_KINDS[shard.suffix]](shard, max_length)
        except OSError as exc:
            raise DataError(f"{shard}: cannot be read ({exc}); fix or remove that shard") from None


def read_records(source: Source, work_dir: Path, num_proc: int = 1, max_length: int = 1 << 20):
    """The records of `source` as a Dataset {"raw", "where", "error"}; Arrow files under `work_dir`. A
    record longer than max_record_bytes(max_length) is kept as an error ("too_long"), without its text."""
    from datasets import Dataset, Features, Value, load_from_disk

    features = Features({"raw": Value("string"), "where": Value("string"), "error": Value("string")})
    if source.kind == "saved":
        try:
            saved = load_from_disk(str(source.path))
        except Exception as exc:
            raise DataError(f"{source.path}: cannot be loaded as a saved dataset ({type(exc).__name__}: {exc})") from None
        if hasattr(saved, "keys"):  # a DatasetDict: its train split
            if "train" not in saved:
                raise DataError(f"{source.path}: a saved DatasetDict without a 'train' split (splits: "
                                f"{', '.join(saved.keys())}); save the split to train on, or name it 'train'")
            saved = saved["train"]
        column = _conversation_column(saved.column_names, source.path)
        where = str(source.path)
        tools = "tools" in saved.column_names
        return saved.map(
            lambda row, i: _checked(
                json.dumps({"messages": row[column], **({"tools": row["tools"]} if tools else {})},
                           ensure_ascii=False, default=str), f"{where}#{i}", max_length),
            with_indices=True, remove_columns=saved.column_names, features=features,
            num_proc=num_proc if num_proc > 1 else None, desc="read", cache_file_name=str(work_dir / "read.arrow"),
            new_fingerprint=hashlib.sha256(where.encode()).hexdigest()[:16])
    from datasets.exceptions import DatasetGenerationError

    shards = [str(s) for s in source.shards]
    try:
        return Dataset.from_generator(_shard_records, gen_kwargs={"shards": shards, "max_length": max_length},
                                      features=features, cache_dir=str(work_dir / "read"),
                                      num_proc=min(num_proc, len(shards)) or None)
    except DatasetGenerationError as exc:  # datasets wraps what the reader raised
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        if cause is None:  # not the data's fault (a full disk under the Arrow writer): keep what lies beneath
            raise
        raise cause from None
    except ValueError as exc:  # datasets: 'Instruction "train" corresponds to no data!'
        if "no data" not in str(exc):
            raise
        raise DataError(f"{source.path} holds no record (its files are empty or blank); pass a chat JSONL with "
                        'one {"messages": [...]} conversation per line, or JSON / Parquet holding them') from None


def first_records(source: Source, n: int, max_length: int) -> list[str]:
    """The raw JSON text of the first `n` readable records of `source`, read without writing anything (a
    sample: dflash.data.cache_space measures the tokens per byte of data on it)."""
    from itertools import islice

    if source.kind == "saved":
        from datasets import load_from_disk

        saved = load_from_disk(str(source.path))
        saved = saved["train"] if hasattr(saved, "keys") else saved
        column = _conversation_column(saved.column_names, source.path)
        return [json.dumps({"messages": row[column]}, ensure_ascii=False, default=str)
                for row in saved.select(range(min(n, len(saved))))]
    records = _shard_records([str(s) for s in source.shards], max_length)
    return [r["raw"] for r in islice((r for r in records if not r["error"]), n)]
