"""A watchdog that removes an emulation run's namespaces when the process that made them dies.

`isthmus emulate` tears its network down on exit, on an exception and on SIGINT / SIGTERM /
SIGHUP. SIGKILL (or the OOM killer) leaves no chance to: the datacenters' agents run in sessions
of their own and would train on, holding the namespaces, until the next emulate cleaned them up.
So the owner starts this reaper as soon as it registers a run:

- in a session of its own (setsid): a Ctrl-C at the terminal or a hang-up reaches the owner,
  which tears down in order, never the reaper;
- in the root network namespace, outside every namespace it may remove;
- reading a pipe whose write end only the owner holds (the kernel closes it when the owner dies,
  however it dies; subprocess makes pipes close-on-exec, so no child inherits it).

At EOF the reaper kills every process inside the run's namespaces and removes them, with the files
those processes held in /dev/shm (:func:`isthmus.launch.netns.delete_prefix`). When the owner has
torn down by itself, it writes ``done`` first and the reaper exits at once, touching nothing. The
owner watches the reaper in turn: a run that has lost it would have no one left to clean up after a
SIGKILL, so its death stops the run (:class:`isthmus.launch.emulate.HelperDied`).
"""

from __future__ import annotations

import signal
import subprocess
import sys

from isthmus.launch import netns

DONE = b"done\n"


def start_reaper(run_id: str) -> subprocess.Popen[bytes]:
    """Start the reaper of run ``run_id``; the returned process's stdin is the pipe it watches."""
    return subprocess.Popen(
        [sys.executable, "-m", "isthmus.launch.reaper", run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


def dismiss_reaper(reaper: subprocess.Popen[bytes]) -> None:
    """The owner tore down by itself: tell the reaper so, and wait for it to exit."""
    assert reaper.stdin is not None
    try:
        reaper.stdin.write(DONE)
        reaper.stdin.close()
    except BrokenPipeError:  # it is gone already (killed by someone else): nothing to tell
        pass
    try:
        reaper.wait(timeout=10)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def reap(run_id: str) -> list[str]:
    """Stop every process in run ``run_id``'s namespaces and remove them; returns the names removed."""

    removed = netns.delete_prefix(netns.run_prefix(run_id))
    netns.unregister_run(run_id)
    return removed


def main(argv: list[str]) -> int:
    (run_id,) = argv
    # The owner's teardown (or death) decides; signals meant for the owner's terminal do not.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    said = sys.stdin.buffer.read()  # returns at EOF: the owner closed the pipe or died
    if said == DONE:
        return 0
    removed = reap(run_id)
    if removed:
        sys.stderr.write(
            f"isthmus emulate: its launcher died; stopped the run's processes and removed {', '.join(removed)}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
