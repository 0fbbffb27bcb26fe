"""The private local Ray dies with its driver, even when the driver is killed with ``kill -9``.

``ray.init(address="local")`` starts a GCS, a raylet, agents and workers as children of the
driver. On a normal exit Ray shuts them down; on SIGKILL nothing runs in the driver, and the
DashboardAgent and RuntimeEnvAgent processes were seen left behind as orphans that ignore
SIGTERM. :func:`reap_children_on_exit` starts a small watchdog process that holds the read
end of a pipe whose write end only the driver has: when the driver dies, for whatever
reason, the pipe closes and the watchdog SIGKILLs the processes it was given and their
descendants (each checked by creation time, so a recycled PID is never hit).

Run as ``python -m erase_tune.tune.execute.reaper PID:CREATED ...`` (internal).
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

__all__ = ["reap_children_on_exit"]

_pipes: list[int] = []


def reap_children_on_exit() -> None:
    """Watch this process; when it exits, kill every process that is its child now."""
    me = psutil.Process()
    victims = [f"{p.pid}:{p.create_time()!r}" for p in me.children(recursive=True)]
    if not victims:
        return
    read, write = os.pipe()
    subprocess.Popen([sys.executable, "-m", "erase_tune.tune.execute.reaper", *victims], stdin=read, start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    os.close(read)
    _pipes.append(write)  # held open for this process's lifetime (os.pipe fds are not inherited)


def _main(argv: list[str]) -> None:
    sys.stdin.buffer.read()  # returns at EOF: the driver is gone
    procs = []
    for item in argv:
        pid, _, created = item.partition(":")
        try:
            p = psutil.Process(int(pid))
            if abs(p.create_time() - float(created)) < 1e-3:
                procs.append(p)
        except (psutil.Error, ValueError):
            continue
    everyone = {p.pid: p for p in procs}
    for p in procs:
        try:
            everyone.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            continue
    for p in everyone.values():
        try:
            p.kill()
        except psutil.Error:
            continue


if __name__ == "__main__":
    _main(sys.argv[1:])
