"""Image benchmark: runtime image size vs the builder's, its biggest layers, doctor wall time (quick and
full) and container start -> healthy, measured side by side in one run.

    python bench/bench_image.py --target cu130-sm120      (make bench-image; builds what is missing)

Sizes come from the engine API (docker SDK); times are wall-clock around `docker run`.
"""

from __future__ import annotations

import argparse
import sys
import time

from images.build import build_image, build_toolkit, build_wheels
from images.engine import client
from wheelbuilder import targets as tg


HEALTH = {"test": ["CMD", "dflash", "healthcheck"], "interval": 1_000_000_000, "timeout": 20_000_000_000,
          "retries": 1, "start_period": 300_000_000_000}


def biggest_layers(image, n: int = 5) -> list[tuple[float, str]]:
    rows = [(layer["Size"] / 1e9, (layer.get("CreatedBy") or "")[:90]) for layer in image.history()]
    return sorted(rows, reverse=True)[:n]


def shared_with(a, b) -> float:
    """GB of layers the two images share (their common RootFS prefix), from the engine's disk usage:
    `SharedSize` of the smaller side is what the other image does not store again."""
    layers_a, layers_b = a.attrs["RootFS"]["Layers"], b.attrs["RootFS"]["Layers"]
    if not layers_a or layers_a[0] != layers_b[0]:
        return 0.0
    df = {img["Id"]: img for img in client().df()["Images"]}
    return min(df[a.id]["SharedSize"], df[b.id]["SharedSize"]) / 1e9


def timed_run(tag: str, args: list[str]) -> float:
    started = time.monotonic()
    client().containers.run(tag, args, network_mode="none", remove=True)
    return time.monotonic() - started


def start_to_healthy(tag: str, timeout: float = 300) -> float:
    started = time.monotonic()
    c = client().containers.run(tag, ["sleep", "900"], detach=True, network_mode="none", healthcheck=HEALTH)
    try:
        while time.monotonic() - started < timeout:
            c.reload()
            if c.attrs["State"].get("Health", {}).get("Status") == "healthy":
                return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError("container did not become healthy")
    finally:
        c.remove(force=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="cu130-sm120", help="target from targets.toml")
    args = p.parse_args()
    target = tg.load().target(args.target)
    build_wheels(target)
    tag = build_image(target)
    builder = build_toolkit(target)
    runtime_img, builder_img = client().images.get(tag), client().images.get(builder)
    quick = timed_run(tag, ["doctor", "--quick"])
    full = timed_run(tag, ["doctor"])
    healthy = start_to_healthy(tag)
    print(f"\nimage benchmark, target {target.name}")
    print(f"  runtime image {tag:<28} {runtime_img.attrs['Size'] / 1e9:6.2f} GB")
    print(f"  builder image {builder:<28} {builder_img.attrs['Size'] / 1e9:6.2f} GB "
          f"(runtime/builder {runtime_img.attrs['Size'] / builder_img.attrs['Size']:.2f}x)")
    shared = shared_with(runtime_img, builder_img)
    together = (runtime_img.attrs["Size"] + builder_img.attrs["Size"]) / 1e9 - shared
    print(f"  shared layers (base, python-torch)   {shared:6.2f} GB: both images together take {together:.2f} GB on disk")
    print("  biggest runtime layers:")
    for size, cmd in biggest_layers(runtime_img):
        print(f"    {size:6.2f} GB  {cmd}")
    print(f"  doctor --quick (docker run, no GPU)  {quick:6.1f} s")
    print(f"  doctor full    (docker run, no GPU)  {full:6.1f} s  ({full / quick:.2f}x quick)")
    print(f"  container start -> healthy           {healthy:6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
