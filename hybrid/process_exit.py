"""Ends a process (the daemon's servers, the `hybridd` command) once its `main` has returned: non-daemon threads are
joined and exit handlers run, as the interpreter would do, then the process exits without the interpreter's teardown
of every module, as multiprocessing's children do. With torch loaded that teardown takes about half a second, which
every stop and every restart of a process would wait for."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable


def exit_after(main: Callable[[], int | None]) -> None:
    try:
        code = main()
    except SystemExit as e:
        code = e.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # the interpreter's own first step: wakes idle executor workers, joins non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
