"""The atomic commit: a new checkpoint appears complete under its name or not at all.

Ranks write into ``<path>.tmp-<token>/``; the coordinator writes the metadata last, fsyncs it
and the directory, and renames the directory into place. When ``<path>`` already exists, the
two directories are swapped with one ``renameat2(RENAME_EXCHANGE)`` and the old one is deleted
afterwards, so a crash at any moment leaves a complete checkpoint under ``<path>`` (DCP deletes
the old metadata first and can lose both). Where the kernel lacks the exchange, the old
directory is first renamed aside to ``<path>.old-<token>``, which :func:`recover` puts back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal

#: Test hook: ``PLURIBUS_CHECKPOINT_CRASH_AT=phase[:rank]`` SIGKILLs the rank at that phase of a
#: save (``writing``, ``before-metadata``, ``before-rename``, ``before-latest``).
CRASH_ENV = "PLURIBUS_CHECKPOINT_CRASH_AT"
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"


def crash_point(phase: str, rank: int) -> None:
    wanted = os.environ.get(CRASH_ENV)
    if not wanted:
        return
    name, _, who = wanted.partition(":")
    if name == phase and (not who or int(who) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_dir(path: str, token: str) -> str:
    return f"{path}{TMP_MARK}{token}"


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(code)}")


def publish(tmp: str, path: str, token: str) -> None:
    """Move the finished ``tmp`` to ``path`` atomically, replacing a checkpoint there only after
    the new one is in place."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.lexists(path):
        os.rename(tmp, path)
        fsync_dir(parent)
        return
    if _exchange(tmp, path):
        fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=True)  # the old checkpoint, now under the tmp name
        return
    aside = f"{path}{OLD_MARK}{token}"
    os.rename(path, aside)
    os.rename(tmp, path)
    fsync_dir(parent)
    shutil.rmtree(aside, ignore_errors=True)


def recover(path: str) -> None:
    """After a crash between the two renames of the fallback, put the old checkpoint back."""
    if os.path.lexists(path):
        return
    parent, name = os.path.split(os.path.abspath(path))
    if not os.path.isdir(parent):
        return
    aside = sorted(e for e in os.listdir(parent) if e.startswith(name + OLD_MARK))
    if aside:
        os.rename(os.path.join(parent, aside[-1]), path)
        fsync_dir(parent)


def write_text_atomically(path: str, text: str) -> None:
    """Replace a small file by write, fsync, rename, fsync the directory."""
    tmp = f"{path}{TMP_MARK}{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
