"""`python -m worker.cli ...` runs the `tlt` command."""

import sys

from worker.cli import main

sys.exit(main())
