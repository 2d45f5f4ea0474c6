"""One run per workdir: an exclusive lock that a second run, on any host, is refused by.

Process 0 creates <workdir>/LOCK atomically (O_EXCL) holding its host, pid and start time
and refreshes its mtime every `heartbeat` seconds; every process of the job learns whether
it got it. A lock is stale when its owner is on this host and no longer alive, or on another
host and silent for `stale_after` seconds; a stale lock is moved aside (renamed, one
contender wins) and taken over, saying so.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Callable, Optional

import jax

from tfm import parallel


class WorkdirLockedError(RuntimeError):
    """Another live run owns the workdir."""


def require_filesystem_path(workdir: str) -> None:
    """Refuses a URL workdir (gs://, s3://, ...): the lock, config.json, metrics, TensorBoard
    logs and vocabularies are written with filesystem calls, which would put them in a local
    directory named after the URL on each host while only the checkpoints reached the bucket."""
    if "://" in os.fspath(workdir):
        raise ValueError(
            f"workdir {os.fspath(workdir)!r} is a URL; tfm writes its workdir with filesystem calls, so "
            "give a path every host sees (for a bucket, a gcsfuse mount such as /gcs/BUCKET/run); "
            "datasets may still be read from gs:// through --config.data_dir")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkdirLock:
    def __init__(self, workdir: str, *, heartbeat: float = 30.0, stale_after: float = 300.0,
                 say: Callable[[str], None] = print):
        require_filesystem_path(workdir)
        self.path = os.path.join(workdir, "LOCK")
        self.heartbeat, self.stale_after, self.say = heartbeat, stale_after, say
        self.stop, self.thread, self.held = threading.Event(), None, False

    def __enter__(self) -> "WorkdirLock":
        error = self._acquire() if jax.process_index() == 0 else None
        if parallel.from_process_0(error is not None) and error is None:
            error = f"process 0 could not lock {self.path}"
        if error:
            raise WorkdirLockedError(error)
        return self

    def _acquire(self) -> Optional[str]:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and not self._stale(owner):
                    return (f"workdir {os.path.dirname(self.path)} is in use by pid {owner['pid']} on "
                            f"host {owner['host']} (lock {self.path}); wait for it to finish or use "
                            "another --workdir")
                self._take_over(owner)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            self.thread = threading.Thread(target=self._beat, daemon=True)
            self.thread.start()
            return None
        return f"could not lock {self.path}: other runs keep taking it"

    def _owner(self) -> Optional[dict]:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            return None  # vanished, or half-written by a process that died while writing it

    def _stale(self, owner: dict) -> bool:
        if owner.get("host") == socket.gethostname():
            return not _alive(int(owner.get("pid", -1)))
        try:
            return time.time() - os.path.getmtime(self.path) > self.stale_after
        except FileNotFoundError:
            return True

    def _take_over(self, owner: Optional[dict]) -> None:
        aside = f"{self.path}.stale-{int(time.time() * 1000)}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another contender moved it first
        who = f"pid {owner['pid']} on {owner['host']}" if owner else "an unreadable owner"
        self.say(f"took over the stale workdir lock of {who} (moved to {aside})")

    def _beat(self):
        while not self.stop.wait(self.heartbeat):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def __exit__(self, *exc):
        self.stop.set()
        if self.held:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            self.held = False
