"""wheelbuilder: reproducible, audited CUDA-extension wheels for a chosen GPU target.

Flow (one direction): targets.toml -> plan -> fetch pinned sdist -> patch arch flags -> compile ->
audit the extension's fatbin -> deterministic wheel -> dist/wheels/<target>/ + manifest.json.
"""

