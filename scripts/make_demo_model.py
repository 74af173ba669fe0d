#!/usr/bin/env python3
"""Write the demo model directories (``demo-model/``, ``demo-vision-model/``) in the package.

The demo fleets read them through the ``config/demo-model`` and
``config/demo-vision-model`` links; they ship in the package so
``simulate-engine`` finds the text one without ``--model-dir``.

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

from direct_frontend.text import demo_model, demo_vision

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = ((demo_model.BUNDLED_DIR, demo_model.build_model_dir),
           (demo_vision.BUNDLED_DIR, demo_vision.build_model_dir))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    failed = False
    for target, build_model_dir in TARGETS:
        if not args.check:
            build_model_dir(target)
            total = sum(f.stat().st_size for f in target.iterdir())
            print(f"wrote {target.relative_to(ROOT)} ({total // 1024} kB)")
            continue
        with tempfile.TemporaryDirectory() as scratch:
            fresh = build_model_dir(pathlib.Path(scratch))
            stale = [
                f.name
                for f in sorted(fresh.iterdir())
                if not (target / f.name).is_file()
                or (target / f.name).read_bytes() != f.read_bytes()
            ]
        if stale:
            print(f"out of date in {target.relative_to(ROOT)}: {', '.join(stale)}",
                  file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
