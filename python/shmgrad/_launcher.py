"""Starting an engine: ``shmgrad serve`` run in the background, watched until it reports
that it serves (or why it could not start), and stopped.

``serve`` reports on a pipe (``--status-fd``): exactly one JSON line, either
``{"event": "serving", ...}`` once every worker is ready, or
``{"event": "failed", "kind": KIND, "message": ...}`` where KIND names the native error
kind (:func:`shmgrad.errors.error_class` maps it to the exception raised here). End of
file without a line means it died without reporting; the error then quotes the end of
its output.

A launcher only runs the process; attaching to the engine is :func:`shmgrad.attach`'s
job (:class:`shmgrad.Engine` does both).
"""

import atexit
import ctypes
import dataclasses
import fcntl
import json
import os
import select
import signal
import sys
import subprocess
import tempfile
import time
import weakref
from typing import List, Optional, Union

from . import errors
from ._native import DEFAULTS, SERVE_OPTIONS, tunable

STATUS_LINE_MARGIN_S = 10.0  # waited for the status line beyond serve's --startup-timeout
STOP_TIMEOUT_S = DEFAULTS["stop_timeout"]  # SIGTERM to exit: serve stops, removes its segment
KILL_WAIT_S = 10.0  # SIGKILL to exit
POLL_INTERVAL_S = 0.2  # how often the wait for the status line checks serve is alive
LOG_TAIL_LINES = 20  # of serve's output, quoted when it dies without reporting
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_live_launchers = weakref.WeakSet()


def installed_binary(program: str, env_var: str) -> str:
    """The path of one of shmgrad's programs: ``$env_var`` if set, else the copy that
    ships in the installed package's ``bin/`` (never the PATH: the ``shmgrad`` found
    there is the console script that runs this very binary)."""
    env = tunable(env_var)
    if env:
        return env
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", program)
    if os.path.exists(here):
        return here
    raise errors.EngineNotFoundError(
        f"the {program} binary is not in {os.path.dirname(here)}: install shmgrad with "
        f"pip install --no-build-isolation . (or set {env_var})"
    )


# `shmgrad serve`'s options, declared once in engine/serve_options.h: name -> its flag
# ("--max-batch"), and name -> its default.
SERVE_FLAGS = {name: option.flag.split(" ")[0] for name, option in SERVE_OPTIONS.items()}
SERVE_DEFAULTS = {name: option.default for name, option in SERVE_OPTIONS.items()}


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """The options of one ``shmgrad serve`` (see ``shmgrad serve --help``): each field is
    the serve option of that name (engine/serve_options.h), given as its flag unless it is
    None or empty (serve's default then applies); ``eager_job`` gives the launchers' own."""

    name: str
    model_path: str
    workers: Union[int, str]  # or "auto" (serve --workers auto)
    loss: str
    dataset: Optional[str] = None
    threads_per_worker: int = SERVE_DEFAULTS["threads_per_worker"]
    max_workers: Optional[int] = None
    max_batch: int = SERVE_DEFAULTS["max_batch"]
    input_capacity_mb: int = SERVE_DEFAULTS["input_capacity_mb"]
    startup_timeout: float = SERVE_DEFAULTS["startup_timeout"]
    eager_job: Optional[object] = None  # shmgrad._job.EagerJob: Python workers run it
    devices: Optional[tuple] = None  # CUDA ordinals (--devices); None: a CPU engine
    numerics: Optional[str] = None  # the workers' torch numerics (_numerics.spec())

    def environment(self) -> Optional[dict]:
        """serve's environment: this process's, and for eager workers a PYTHONPATH that
        lets them import whatever this process can (the job may name classes of the
        trainer's own modules, pickled by reference)."""
        if self.eager_job is None:
            return None
        env = dict(os.environ)
        paths = [os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([os.getcwd()] + paths))
        return env

    def arguments(self) -> List[str]:
        """serve's command line: each field's flag (from the native list) and value, a list
        joined by commas; the eager job's options; the threads left to serve with auto."""
        args = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "eager_job" or value is None or value in ("", ()):
                continue  # serve's default
            if field.name == "threads_per_worker" and self.workers == "auto":
                continue  # auto: serve chooses the threads too
            if isinstance(value, (tuple, list)):
                value = ",".join(str(v) for v in value)
            args += [SERVE_FLAGS[field.name], str(value)]
        if self.eager_job is not None:
            args += self.eager_job.serve_arguments()
        return args


def _set_parent_death_signal():  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass  # only a safety net: stop() and the atexit hook stop serve too


class Launcher:
    """Runs one ``shmgrad serve`` process and owns it.

    :meth:`start` returns once the engine serves; :meth:`stop` (also called at exit, and
    by the kernel's parent-death signal if this process dies) stops it. Its output goes
    to a temporary file, readable with :meth:`log` until the launcher is dropped.
    """

    def __init__(self, options: ServeOptions):
        self.options = options
        self.serving: Optional[dict] = None  # serve's "serving" line, once it came
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def pid(self) -> Optional[int]:
        return None if self._proc is None else self._proc.pid

    def start(self) -> dict:
        """Starts serve and waits for its status line: returns the ``serving`` event.

        Raises the error serve reported (``errors.error_class(kind)``), an
        :class:`~shmgrad.Error` quoting its output if it died without reporting, or
        :class:`~shmgrad.EngineTimeoutError` if it did not report within
        ``startup_timeout + STATUS_LINE_MARGIN_S``. In every case serve is stopped.
        """
        if self._proc is not None:
            raise errors.InvalidArgumentError(f"engine {self.options.name!r} was started already")
        read_end, write_end = os.pipe()
        try:
            cmd = [
                installed_binary("shmgrad", "SHMGRAD_BINARY"),
                "serve",
                *self.options.arguments(),
                SERVE_FLAGS["status_fd"],
                str(write_end),
            ]
            self._log = tempfile.TemporaryFile()
            # serve writes through a copy of this descriptor, sharing its file offset:
            # appending, its writes land at the end whatever log() reads meanwhile.
            flags = fcntl.fcntl(self._log.fileno(), fcntl.F_GETFL)
            fcntl.fcntl(self._log.fileno(), fcntl.F_SETFL, flags | os.O_APPEND)
            # Readable after stop(); closed when the launcher goes (no ResourceWarning).
            weakref.finalize(self, self._log.close)
            self._proc = subprocess.Popen(
                cmd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(write_end,),
                preexec_fn=_set_parent_death_signal,
                env=self.options.environment(),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # serve holds the only write end: its exit is our EOF
        _live_launchers.add(self)
        try:
            event = self._read_event(read_end)
        except BaseException:
            self.stop()
            raise
        finally:
            os.close(read_end)
        if event.get("event") == "serving":
            self.serving = event
            return event
        self.stop()
        if event.get("event") == "failed":
            raise errors.error_class(event.get("kind", ""))(
                event.get("message") or f"engine {self.options.name!r} failed to start"
            )
        raise errors.Error(f"engine {self.options.name!r} reported an unknown event: {event!r}")

    def _read_event(self, fd) -> dict:
        """serve's one status line, parsed. Bounded by the start-up timeout."""
        timeout = self.options.startup_timeout + STATUS_LINE_MARGIN_S
        deadline = time.monotonic() + timeout
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.EngineTimeoutError(
                    f"engine {self.options.name!r} did not report within {timeout:g} s "
                    f"(startup_timeout {self.options.startup_timeout:g} s); its output ends:\n"
                    f"{self.log_tail()}"
                )
            readable, _, _ = select.select([fd], [], [], min(left, POLL_INTERVAL_S))
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break  # end of file: serve closed the pipe or died
                data += chunk
            elif self._proc.poll() is not None:
                break  # died, and a process it started still holds the pipe open
        line, newline, _ = data.partition(b"\n")
        if not newline:
            self.stop()
            raise errors.Error(
                f"engine {self.options.name!r} exited during start-up without reporting why "
                f"({_exit_description(self._proc.returncode)}); its output ends:\n"
                f"{self.log_tail()}"
            )
        try:
            event = json.loads(line)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            raise errors.Error(
                f"engine {self.options.name!r} wrote an unreadable status line: {line[:200]!r}"
            )
        return event

    def stop(self, timeout: float = STOP_TIMEOUT_S):
        """Stops serve: SIGTERM, then SIGKILL if it has not exited within ``timeout``
        seconds. Idempotent. Raises EngineTimeoutError if even SIGKILL did not end it."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                raise errors.EngineTimeoutError(
                    f"engine {self.options.name!r}: serve (pid {proc.pid}) did not exit "
                    f"{KILL_WAIT_S:g} s after SIGKILL"
                ) from None

    def log(self) -> str:
        """What serve and its workers have printed so far."""
        if self._log is None:
            return ""
        # pread: the offset serve writes at is left alone.
        fd, chunks, offset = self._log.fileno(), [], 0
        while chunk := os.pread(fd, 1 << 16, offset):
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks).decode(errors="replace")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        text = self.log().rstrip()
        return "\n".join(text.splitlines()[-lines:]) if text else "(no output)"


def _exit_description(returncode) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


@atexit.register
def _stop_all():
    for launcher in list(_live_launchers):
        try:
            launcher.stop()
        except Exception:
            pass  # exiting anyway; the parent-death signal is the last resort
