"""`ember` on the command line: facts about the installation."""

from __future__ import annotations

import argparse
import platform
import sys

import numpy

import ember


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ember", description="ember: a lazy deep-learning framework")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions and available devices")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(f"ember {ember.__version__}  python {platform.python_version()}  numpy {numpy.__version__}")
        print("devices: cpu (reference backend)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
