"""``python -m pluribus.checkpoint consolidate <ckpt> out.safetensors`` and
``python -m pluribus.checkpoint inspect <ckpt> [--verify]``."""

from __future__ import annotations

import argparse
import sys

from .consolidate import consolidate, describe
from .errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pluribus.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write every tensor whole into one safetensors file")
    c.add_argument("checkpoint")
    c.add_argument("output")
    c.add_argument("--no-verify", action="store_true", help="skip the checksums")
    i = sub.add_parser("inspect", help="list the tensors and values of a checkpoint")
    i.add_argument("checkpoint")
    i.add_argument("--verify", action="store_true", help="read every byte and check it")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            consolidate(args.checkpoint, args.output, verify=not args.no_verify)
            print(f"wrote {args.output}")
        else:
            print(describe(args.checkpoint, verify=args.verify))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
