"""exit_after: a server process's exit code, output and exit handlers survive skipping the module teardown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, sys, threading
from concurrent.futures import ThreadPoolExecutor
from hybrid.process_exit import exit_after

def main():
    atexit.register(lambda: print("atexit ran", flush=True))
    ThreadPoolExecutor(1).submit(lambda: None).result()  # an idle worker left open, as a library might
    done = threading.Thread(target=lambda: print("thread finished"))
    done.start()
    sys.stdout.write("unflushed output")
    return {code}

exit_after(main)
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(code=code)], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parent.parent)


def test_exit_code_output_threads_and_handlers():
    r = run("3")
    assert r.returncode == 3
    assert "unflushed output" in r.stdout and "thread finished" in r.stdout and "atexit ran" in r.stdout


def test_a_message_as_exit_code_goes_to_stderr():
    r = run("'no layers'")
    assert r.returncode == 1 and r.stderr.strip() == "no layers"
