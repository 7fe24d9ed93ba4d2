"""The software bill of materials of an image's Python environment: CycloneDX 1.5 JSON, written at build
time inside the image (the Dockerfile's runtime stage runs `python -m images.sbom`) and attached to what
`publish` pushes.

One component per installed distribution of the venv (importlib.metadata, so exactly what is there),
with the name, version, `pkg:pypi` purl and license the distribution declares, and:

    hashes     the sha256 of every file the lock allows for that pin (locks/<lock>/*.txt, `--hash=`)
               or, for a wheel this project built, the wheel's sha256 from its manifest.json
    properties dflash:lock (which lock file pinned it) or dflash:wheel (the built wheel's file name);
               dflash:unlocked=true for a distribution no lock names (the venv's own pip, the project)

The file has no time stamp and its serial number is derived from its content, so the same image always
yields the same SBOM (spec: https://cyclonedx.org/docs/1.5/json/).

    python -m images.sbom --locks /opt/dflash/locks --wheels /opt/dflash/wheels/manifest.json \
        --out /opt/dflash/sbom.cdx.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import uuid
from importlib import metadata
from pathlib import Path
from urllib.parse import quote

MEDIA_TYPE = "application/vnd.cyclonedx+json"
SPEC_VERSION = "1.5"
IMAGE_PATH = "/opt/dflash/sbom.cdx.json"  # where the runtime image keeps it (label io.dflash.sbom)

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def canonical(name: str) -> str:
    """PEP 503 normalised name (what purls and lock files compare by)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(text: str) -> dict[str, tuple[str, list[str]]]:
    """A pip-compile/uv lock with hashes -> {canonical name: (version, [sha256, ...])}."""
    pins: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in text.splitlines():
        m = _PIN.match(line)
        if m:
            current = canonical(m.group(1))
            pins[current] = (m.group(2), [])
        elif current and not line.startswith((" ", "\t")):
            current = None
        if current:
            pins[current][1].extend(_HASH.findall(line))
    return pins


def _license(meta) -> dict | None:
    expr = meta.get("License-Expression")
    if expr:
        return {"expression": expr.strip()}
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 64 and text.upper() != "UNKNOWN":
        return {"license": {"name": text}}
    for c in meta.get_all("Classifier") or []:
        if c.startswith("License :: ") and not c.endswith(":: OSI Approved"):
            return {"license": {"name": c.rsplit(" :: ", 1)[-1]}}
    return None


def components(dists, locks: dict[str, dict], wheels: dict[str, dict]) -> list[dict]:
    """CycloneDX components for `dists` (importlib.metadata distributions); see the module docstring."""
    out = []
    seen = set()
    for dist in dists:
        name = dist.metadata["Name"]
        key = canonical(name)
        if not name or key in seen:
            continue
        seen.add(key)
        version = dist.version
        purl = f"pkg:pypi/{key}@{quote(version, safe='.-_~')}"  # a local version's '+' is %2B in a purl
        comp = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl}
        lic = _license(dist.metadata)
        if lic:
            comp["licenses"] = [lic]
        props = []
        wheel = wheels.get(key)
        if wheel and wheel["version"] == version:
            comp["hashes"] = [{"alg": "SHA-256", "content": wheel["sha256"]}]
            props.append({"name": "dflash:wheel", "value": wheel["filename"]})
        else:
            for lock_name, pins in locks.items():
                pin = pins.get(key)
                if pin and pin[0] == version:
                    comp["hashes"] = [{"alg": "SHA-256", "content": h} for h in pin[1]]
                    props.append({"name": "dflash:lock", "value": lock_name})
                    break
            else:
                props.append({"name": "dflash:unlocked", "value": "true"})
        comp["properties"] = props
        out.append(comp)
    return sorted(out, key=lambda c: c["bom-ref"])


def read_wheels(manifest: Path | None) -> dict[str, dict]:
    """{canonical name: {filename, version, sha256}} of the wheels a wheelbuilder manifest lists."""
    if manifest is None or not manifest.exists():
        return {}
    out = {}
    for w in json.loads(manifest.read_text()).get("wheels", []):
        dist, version = w["filename"].split("-")[:2]
        out[canonical(dist)] = {"filename": w["filename"], "version": version, "sha256": w["sha256"]}
    return out


def build(locks_dir: Path, wheels_manifest: Path | None = None, dists=None, subject: dict | None = None) -> dict:
    """The SBOM document. `subject`: the metadata.component (defaults to the dflash-train image)."""
    locks = {p.name: parse_lock(p.read_text()) for p in sorted(Path(locks_dir).glob("*.txt"))}
    comps = components(dists if dists is not None else metadata.distributions(), locks,
                       read_wheels(wheels_manifest))
    body = {"components": comps}
    serial = uuid.uuid5(uuid.NAMESPACE_URL, "sha256:" + hashlib.sha256(
        json.dumps(body, sort_keys=True).encode()).hexdigest())
    return {
        "bomFormat": "CycloneDX",
        "specVersion": SPEC_VERSION,
        "serialNumber": f"urn:uuid:{serial}",
        "version": 1,
        "metadata": {
            "tools": {"components": [{"type": "application", "name": "images.sbom", "group": "dflash-images"}]},
            "component": subject or {"type": "container", "bom-ref": "dflash-train", "name": "dflash-train"},
            "properties": [{"name": "dflash:python", "value": sys.version.split()[0]}],
        },
        **body,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m images.sbom", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--locks", type=Path, required=True, help="folder of the hash-pinned lock files (*.txt)")
    p.add_argument("--wheels", type=Path, help="the built wheels' manifest.json")
    p.add_argument("--name", default="dflash-train", help="the subject component's name")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    doc = build(a.locks, a.wheels, subject={"type": "container", "bom-ref": a.name, "name": a.name})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    unlocked = [c["name"] for c in doc["components"] if {"name": "dflash:unlocked", "value": "true"} in c["properties"]]
    print(f"{a.out}: {len(doc['components'])} components, CycloneDX {SPEC_VERSION}"
          + (f"; not in a lock: {', '.join(unlocked)}" if unlocked else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
