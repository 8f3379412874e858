"""What every `tlt` command shares: exit statuses and printing a line to stdout."""

from __future__ import annotations

import sys

EXIT_FAILED, EXIT_CANCELLED, EXIT_API = 1, 3, 4


def out(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def exit_code_for(status: str) -> int:
    return {"succeeded": 0, "failed": EXIT_FAILED, "cancelled": EXIT_CANCELLED}.get(status, 0)
