"""The ``dbsp`` command line: ``python -m dbsp_core demo`` runs the main job."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dbsp", description="dbsp_core command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo pipeline on the embedded runtime")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from dbsp_core.demo import run_demo

        return run_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
