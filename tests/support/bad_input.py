"""What every bad-input suite (tests/test_bad_input_*.py) asserts of a refused command: the documented exit
code, the key words of its message, no traceback, and nothing new left in the directories it was given."""

from __future__ import annotations

from pathlib import Path


def snapshot(*dirs: Path) -> set[str]:
    """Every path under `dirs` (a directory that does not exist counts as empty)."""
    return {str(p) for d in dirs if d.exists() for p in d.rglob("*")}


def assert_clear_failure(code, expected: int, text: str, words) -> None:
    """`code` is `expected`, `text` (what the command printed) holds every one of `words`, and no traceback."""
    assert code == expected, text
    for word in words:
        assert word in text, f"{word!r} not in: {text}"
    assert "Traceback" not in text
