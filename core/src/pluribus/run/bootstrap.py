"""What each rank runs first: ``python .../pluribus/run/bootstrap.py script.py args`` (or
``-m module args``).

The launcher runs this file by its path, not as ``-m pluribus.run.bootstrap``, so that nothing
(not even ``import pluribus``) is loaded before the user's program; it uses the standard library
only, and this folder must hold no module named like one of the standard library's (it is
first on ``sys.path`` while the imports below run).

It makes the rank die with its launcher (``PR_SET_PDEATHSIG``), runs the user's program as
``__main__`` exactly as ``python script.py`` would, and when the program dies of an uncaught
exception it writes the traceback as JSON to ``$PLURIBUS_ERROR_FILE`` (read by the launcher for
its failure summary) and dumps the flight recorder. When the launcher stops the rank with SIGTERM
it dumps the flight recorder too, then dies of SIGTERM as it would have without the handler.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback

ERROR_FILE_ENV = "PLURIBUS_ERROR_FILE"
LAUNCHER_PID_ENV = "PLURIBUS_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the launcher dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The launcher may have died before prctl took effect: then our parent is someone else.
    # (Removed from the environment: it names this rank's parent, not its children's.)
    launcher = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        os._exit(128 + signal.SIGKILL)


def _dump_flight_recorder(reason: str) -> None:
    recorder = sys.modules.get("pluribus.debug.flight_recorder")
    if recorder is not None:
        try:
            recorder.dump(reason)
        except Exception:
            pass


def _on_sigterm(signum, frame) -> None:
    _dump_flight_recorder(f"stopped by {signal.Signals(signum).name}")
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _launch_frame(filename: str) -> bool:
    return filename == "<frozen runpy>" or os.path.abspath(filename) in (
        os.path.abspath(__file__),
        os.path.abspath(runpy.__file__),
    )


def user_frames(tb):
    """Skip the frames of this module and runpy, so the traceback starts in the user's code."""
    while tb is not None and _launch_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def _plumbing_folders() -> list[str]:
    """Folders of the hook machinery between a collective call and its error."""
    folders = []
    for name in ("pluggy", "pluribus.debug"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            folders.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
    return folders


def condensed_traceback(exc: BaseException, tb) -> str:
    """The traceback without the frames of pluggy and the debugging wrappers (a collective
    call passes through a dozen of them), keeping the frame that raised."""
    report = traceback.TracebackException(type(exc), exc, tb)
    folders = _plumbing_folders()
    frames = list(report.stack)
    kept = [
        frame
        for i, frame in enumerate(frames)
        if i == len(frames) - 1
        or not any(os.path.abspath(frame.filename).startswith(f) for f in folders)
    ]
    report.stack = traceback.StackSummary.from_list(kept)
    lines = list(report.format())
    hidden = len(frames) - len(kept)
    if hidden and lines and lines[0].startswith("Traceback"):
        note = f"  ({hidden} frames of pluggy and pluribus.debug hook wrappers not shown)\n"
        lines.insert(1, note)
    return "".join(lines)


def write_error_file(exc: BaseException, tb) -> None:
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    record = {
        "rank": int(os.environ.get("RANK", -1)),
        "local_rank": int(os.environ.get("LOCAL_RANK", -1)),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "exc_type": type(exc).__qualname__,
        "exc_module": type(exc).__module__,
        "message": str(exc),
        "traceback": condensed_traceback(exc, tb),
        "full_traceback": "".join(traceback.format_exception(type(exc), exc, tb)),
        "time": time.time(),
    }
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass


def run(argv: list[str]) -> None:
    """Run ``argv`` (``[script, args...]`` or ``["-m", module, args...]``) as ``__main__``."""
    if not argv:
        sys.exit("usage: python -m pluribus.run.bootstrap (script.py | -m module) [args...]")
    if argv[0] == "-m":
        if len(argv) < 2:
            sys.exit("pluribus.run.bootstrap: -m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    die_with_parent()
    signal.signal(signal.SIGTERM, _on_sigterm)
    # A rank that crashes in native code (SIGSEGV, SIGABRT...) prints its Python stack, which the
    # launcher's summary shows from the rank's last lines of stderr.
    faulthandler.enable()
    # Python put this file's folder (or, under -m, the working directory) first on sys.path;
    # the user's program should see the path it would see when run directly.
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") in (here, os.getcwd()):
        sys.path.pop(0)
    try:
        run(sys.argv[1:])
    except SystemExit as exc:
        if exc.code not in (None, 0):
            # an exit code is a failure too: record when it happened, so that the summary
            # orders it before the errors it caused on the other ranks
            write_error_file(exc, user_frames(exc.__traceback__))
        raise
    except BaseException as exc:
        tb = user_frames(exc.__traceback__)
        write_error_file(exc, tb)
        _dump_flight_recorder(f"uncaught {type(exc).__name__}: {exc}")
        traceback.print_exception(type(exc), exc, tb)
        sys.stderr.flush()
        sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 1)


if __name__ == "__main__":
    main()
