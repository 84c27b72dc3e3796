"""A bench killed with SIGTERM stops what it started: ``exit_on_sigterm`` turns the signal
into SystemExit, so ``enforced_node``'s clean-up (and any ``finally``) runs. A real child
process, signalled once it is inside its ``try``."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, time
from pathlib import Path
from agent.emulators.enforcednode import exit_on_sigterm
exit_on_sigterm()
done = Path(sys.argv[1])
try:
    print("inside", flush=True)
    time.sleep(60)
finally:
    done.write_text("cleaned up")
"""


def test_sigterm_runs_the_clean_up_and_exits_143(tmp_path: Path) -> None:
    done = tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(done)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "inside"  # waits on the child's own word
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert done.read_text() == "cleaned up"
