"""`python -m hybrid.cli` runs the `hybridd` command line."""

from hybrid.cli.main import run

run()
