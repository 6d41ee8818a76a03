"""`python -m pergrad.cli`: the `pergrad` command."""

import sys

from pergrad.cli import main

sys.exit(main())
