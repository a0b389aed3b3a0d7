"""The `hybridd` command line: one file per command family, plus the terminal chat, SLO report and doctor."""
