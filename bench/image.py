"""The image: a clean build's time and the image's size.

Runs `deploy/image/build.sh --no-cache` (what `make image` runs, without podman's layer
cache; the debootstrap base stays cached, so its first creation is not counted: the script
makes it first if it is missing) and reads the sizes podman reports. As root, with podman and
debootstrap installed (deploy/host/setup.sh). Apt and PyPI downloads are part of the time.

    .venv/bin/python bench/image.py [--dockerfile FILE] [--tag TAG]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "deploy/image/build.sh"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dockerfile", default="Dockerfile", help="relative to the repository root")
    parser.add_argument("--tag", default="ghcr.io/vcuda-agent/vcuda-agent:0.1.0")
    args = parser.parse_args()
    env = {**os.environ, "DOCKERFILE": args.dockerfile, "IMAGE": args.tag}
    base = subprocess.run([str(BUILD), "--base-only"], cwd=ROOT, env=env, capture_output=True, text=True)
    if base.returncode != 0:
        print(base.stdout + base.stderr, file=sys.stderr)
        return 1
    start = time.monotonic()
    out = subprocess.run([str(BUILD), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    if out.returncode != 0:
        print(out.stdout[-4000:] + out.stderr[-4000:], file=sys.stderr)
        return 1
    match = re.search(r"size_mb=([\d.]+) build_s=([\d.]+) total_s=[\d.]+ base_mb=([\d.]+)", out.stdout)
    if match is None:
        print(f"no size line in the build's output:\n{out.stdout[-2000:]}", file=sys.stderr)
        return 1
    image_mb, build_s, base_mb = match.groups()
    print(
        f"{args.tag} from {args.dockerfile}: {image_mb} MB, clean build {build_s} s ({elapsed:.1f} s in all)"
    )
    print(f"RESULT image_mb={image_mb} build_s={build_s} base_mb={base_mb}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
