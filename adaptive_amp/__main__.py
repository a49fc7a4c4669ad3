"""Command line: ``python -m adaptive_amp info | bench``."""

from __future__ import annotations

import argparse
import json
import sys


def _info(_args) -> int:
    import adaptive_amp

    info = adaptive_amp.build_info()
    info["cuda_available"] = adaptive_amp.cuda_available()
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        info["torch"] = None
    print(json.dumps(info, indent=2))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaptive_amp")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="how this copy was built and what it can use")
    sub.add_parser("bench", help="kernel microbenchmarks (see --help after bench)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "info":
        return _info(args)
    if args.command == "bench":
        from . import bench

        bench.main(rest)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
