"""The main thread's wait for the agent's signals (agent/platform/signalwait.py), in a child
Python whose main thread blocks the signals, so that the kernel hands them to another
thread: the case a main thread asleep in a lock never wakes from."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, signal, threading
    from agent.platform.signalwait import SignalWaiter

    waiter = SignalWaiter([signal.SIGTERM, signal.SIGHUP])
    parked = threading.Event()
    other = threading.Thread(target=lambda: parked.wait(60), daemon=True)
    other.start()  # made before the mask below: it takes the signals
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGHUP})
    print("none", [s.name for s in waiter.wait(0.05)], flush=True)
    os.kill(os.getpid(), signal.SIGHUP)
    print("first", [s.name for s in waiter.wait()], flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("second", [s.name for s in waiter.wait()], flush=True)
    waiter.close()
    print("restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
    """
)


def test_a_signal_another_thread_took_still_ends_the_main_threads_wait() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "none []",
        "first ['SIGHUP']",
        "second ['SIGTERM']",
        "restored True",
    ]
