#!/usr/bin/env python3
"""Write the demo model directory to ``direct_frontend/text/demo-model/``.

The demo fleet reads it through the ``config/demo-model`` link; it ships in
the package so ``simulate-engine`` finds it without ``--model-dir``.

The output is deterministic, so the directory is committed and this script
only needs rerunning when :mod:`direct_frontend.text.demo_model` changes.

Usage::

    python scripts/make_demo_model.py           # regenerate in place
    python scripts/make_demo_model.py --check   # exit 1 if the committed files differ
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

from direct_frontend.text.demo_model import BUNDLED_DIR, build_model_dir

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET = BUNDLED_DIR


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        build_model_dir(TARGET)
        total = sum(f.stat().st_size for f in TARGET.iterdir())
        print(f"wrote {TARGET.relative_to(ROOT)} ({total // 1024} kB)")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        fresh = build_model_dir(pathlib.Path(scratch))
        stale = [
            f.name
            for f in sorted(fresh.iterdir())
            if not (TARGET / f.name).is_file() or (TARGET / f.name).read_bytes() != f.read_bytes()
        ]
    if stale:
        print(f"out of date in {TARGET.relative_to(ROOT)}: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
