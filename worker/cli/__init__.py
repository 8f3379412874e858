"""The `tlt` command (pyproject [project.scripts]; `python -m worker.cli`), one module per concern: parser.py the
command line and its usage text, admin.py database and tokens, up.py the embedded stack and its demo, jobs.py the REST
client commands, output.py exit statuses. Library commands (train, selfcheck, bench) go to worker/tlt untouched.
"""

from __future__ import annotations

import importlib
import logging
import sys

from worker.cli.admin import create_token
from worker.cli.output import EXIT_API, EXIT_CANCELLED, EXIT_FAILED
from worker.cli.parser import BENCH_SUBCOMMANDS, LIBRARY_COMMANDS, build_parser

__all__ = ["EXIT_API", "EXIT_CANCELLED", "EXIT_FAILED", "build_parser", "create_token", "main"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "alembic.runtime.plugins"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCH_SUBCOMMANDS:
        return int(importlib.import_module(BENCH_SUBCOMMANDS[argv[1]]).main(argv[2:]))
    if argv and argv[0] in LIBRARY_COMMANDS:
        module = importlib.import_module(LIBRARY_COMMANDS[argv[0]][0])
        return int(module.main(argv[1:]))
    args = build_parser().parse_args(argv)
    import httpx

    from worker.client import ApiError

    try:
        return int(args.func(args))
    except httpx.TransportError as e:  # refused, timed out, name not resolved: say where we tried
        sys.stderr.write(f"tlt: cannot reach the TLT API at {getattr(args, 'url', '?')}: {e}\n")
        return EXIT_API
    except (ApiError, httpx.HTTPError) as e:
        sys.stderr.write(f"tlt: {e}\n")
        return EXIT_API
    except (OSError, ValueError) as e:  # unreadable spec file, unknown preset, unwritable output directory
        sys.stderr.write(f"tlt: {e}\n")
        return EXIT_API
