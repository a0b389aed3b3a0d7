"""`python -m hybrid.cli` runs the `hybridd` command line."""

import sys

from hybrid.cli.main import main

sys.exit(main())
