"""Profiles of a window of steps (`--profile START:END`), the live profiler server, and the run id they are kept
under.

Every process traces steps START .. END-1 with jax.profiler into a private temp folder, then copies its XSpace to
`CKPT_DIR/profiles/RUN_ID/plugins/profile/steps_START_END/<host>-p<process>.xplane.pb`: TensorBoard's profile
plugin layout (`tensorboard --logdir CKPT_DIR/profiles/RUN_ID` or the whole --ckpt-dir), on gs:// as locally.
The host part of the name carries the process id because several processes may share a host name (local mode).
The session name is the window, the same on every process, so one session holds every host's trace.

Every training process also serves jax.profiler on PROFILER_PORT + its process id (TPUCTL_PROFILER_PORT sets the
base; 0 = off), so that TensorBoard's "capture profile" (and `tpuctl profile`) can take a trace of a running job.
The process id is added so that processes sharing a machine (local mode) never race for one port; a port some
other program holds, or a host that lets no socket listen (named by the bind's errno), is reported in one line
and the run goes on without a server (a --profile window is still traced to files).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainer.common.config import UsageError

PROFILES = "profiles"             # under --ckpt-dir
PROFILER_PORT = 9999              # jax.profiler's server: this + the process id (docs/CONTRACTS.md)
PORT_ENV = "TPUCTL_PROFILER_PORT"
RUN_ID_ENV = "TPUCTL_RUN_ID"      # set by `tpuctl run` for every host of one run
RUN_ID_KEY = "tpuctl_run_id"      # the coordination service key process 0 shares its id under otherwise


@dataclass(frozen=True)
class Window:
    """Steps start .. end-1 (a half-open range, as a Python slice: 5:8 is steps 5, 6 and 7)."""
    start: int
    end: int

    def __contains__(self, step: int) -> bool:
        return self.start <= step < self.end

    @property
    def last(self) -> int:
        return self.end - 1

    @property
    def session(self) -> str:
        return f"steps_{self.start}_{self.end}"

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


def parse_window(text: str, flag: str = "--profile") -> Window | None:
    """'START:END' -> Window; '' -> None. Bad input is one UsageError line."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    if not sep or not start.strip().isdigit() or not end.strip().isdigit():
        raise UsageError(f"{flag} {text}: expected START:END, the steps to trace, e.g. {flag} 5:8 for steps 5, 6 "
                         "and 7")
    w = Window(int(start), int(end))
    if w.start < 1:
        raise UsageError(f"{flag} {text}: steps start at 1")
    if w.end <= w.start:
        raise UsageError(f"{flag} {text}: the window is {'empty' if w.end == w.start else 'reversed'}; END is the "
                         f"first step after it, e.g. {flag} {w.start}:{w.start + 3}")
    return w


def check_window(w: Window | None, total: int, flag: str = "--profile", what: str = "--steps") -> None:
    """The window must end by the run's last step (END may be last + 1)."""
    if w is not None and w.last > total:
        raise UsageError(f"{flag} {w}: the run ends at step {total} ({what}); trace steps up to {total}, e.g. "
                         f"{flag} {max(1, total - 2)}:{total + 1}")


# --- run id ----------------------------------------------------------------------------------------

def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def run_id(timeout_s: float = 60.0) -> str:
    """TPUCTL_RUN_ID (every host of a `tpuctl run` gets the same), else process 0's new id shared through the
    coordination service, else a new id."""
    rid = os.environ.get(RUN_ID_ENV, "").strip()
    if rid:
        return rid
    import jax
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None or jax.process_count() < 2:
        return new_run_id()
    if jax.process_index() == 0:
        client.key_value_set(RUN_ID_KEY, new_run_id(), allow_overwrite=True)
    return client.blocking_key_value_get(RUN_ID_KEY, int(timeout_s * 1000))


def host_name(process: int) -> str:
    """The `<host>` of this process's `<host>.xplane.pb`."""
    return f"{socket.gethostname()}-p{process}"


# --- the profiler server -----------------------------------------------------------------------------

_server: tuple | None = None  # (server, port): one per process, kept for its life


def server_port(process: int) -> int | None:
    """The profiler server's port of process `process` (None: off)."""
    base = int(os.environ.get(PORT_ENV, PROFILER_PORT) or 0)
    return base + process if base else None


def start_server(process: int) -> tuple[int | None, str]:
    """Serve jax.profiler on server_port(process): (the port, "") or (None, why not). jax's server only logs a
    failed bind, so the port is tried first: one another program holds is named taken; a bind this host refuses
    (a sandbox where no socket may listen) is named by its errno."""
    global _server
    if _server is not None:
        return _server[1], ""
    port = server_port(process)
    if port is None:
        return None, f"{PORT_ENV}=0"
    if (err := _bind_error(port)) is not None:
        if err.errno == errno.EADDRINUSE:
            return None, f"port {port} is taken on this host (set {PORT_ENV} to another base)"
        name = errno.errorcode.get(err.errno, f"errno {err.errno}")
        return None, (f"this host refuses to listen on port {port} ({name}: {err.strerror}); --profile still "
                      "traces its window to files under --ckpt-dir")
    import jax
    _server = (jax.profiler.start_server(port), port)
    return port, ""


def stop_server() -> None:
    """The run is over: its port is free again (a process that trains more than once, as a test's, would otherwise
    hold it for good and every later trainer on the machine would find it taken)."""
    global _server
    if _server is not None:
        import jax
        jax.profiler.stop_server()
        _server = None


def _bind_error(port: int) -> OSError | None:
    """Why nothing may listen on `port` on any address (the server binds [::]:port), or None when it may."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, port))
            return None
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                continue  # no IPv6 here: ask IPv4
            return e
    return None  # unreachable: IPv4's answer is returned


# --- one window's trace ----------------------------------------------------------------------------

def trace_options():
    """jax.profiler's defaults but for its Python tracer (level 0): that one hooks every Python call on every thread
    of the process (W&B's, the stall clock's) for the whole window, which the split and the ops never read (they
    come from XLA's and the runtime's own events, and the steps from the loop's annotations)."""
    import jax
    opts = jax.profiler.ProfileOptions()
    opts.python_tracer_level = 0
    return opts


class Recorder:
    """Traces the window's steps on this process and keeps the trace under the run's --ckpt-dir.

    The loop calls `begin(step, state)` before dispatching each step, `annotate(step)` around it and `end(step, state)`
    after it; `close()` at the end, also when the run stops inside the window (what was traced is kept).
    `begin` and `end` return the seconds they took (starting the trace; stopping it and copying it out), which
    the loop keeps out of its step times: the profiler's own cost is not a step's."""

    def __init__(self, window: Window | None, ckpt_dir: str, process: int, run: str | None = None):
        self.window, self.ckpt_dir, self.process = window, ckpt_dir, process
        self.run = run
        self._tmp: str | None = None
        self.kept: str | None = None  # where the trace went

    @property
    def dest(self) -> str:
        return f"{self.ckpt_dir.rstrip('/')}/{PROFILES}/{self.run}/plugins/profile/{self.window.session}"

    def begin(self, step: int, state=None) -> float:
        if self.window is None or self._tmp is not None or step not in self.window:
            return 0.0
        import jax
        # the steps already dispatched finish first: their work is theirs, not the profiler start's, which the
        # loop leaves out of step times (the device would go on with them while the trace starts)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        self.run = self.run or run_id()
        self._tmp = tempfile.mkdtemp(prefix="tpuctl-profile-")
        jax.profiler.start_trace(self._tmp, profiler_options=trace_options())
        return time.perf_counter() - t0

    def annotate(self, step: int):
        # Also while the profiler server runs: a live capture (TensorBoard's, `tpuctl profile`) can start at any
        # step, and the report splits its trace into steps by these marks, as a window's. Outside a trace a mark
        # is one flag check in the profiler.
        if self._tmp is None and _server is None:
            return contextlib.nullcontext()
        import jax
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def end(self, step: int, state) -> float:
        if self._tmp is None or step != self.window.last:
            return 0.0
        import jax
        jax.block_until_ready(state)  # the device's last ops of the window are in the trace, and in the step
        t0 = time.perf_counter()
        self._stop()
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._tmp is not None:
            self._stop()

    def _stop(self) -> None:
        import jax
        from etils import epath
        tmp, self._tmp = self._tmp, None
        try:
            jax.profiler.stop_trace()
            found = sorted(Path(tmp).glob("plugins/profile/*/*.xplane.pb"))
            if found:
                dest = epath.Path(self.dest)
                dest.mkdir(parents=True, exist_ok=True)
                target = dest / f"{host_name(self.process)}.xplane.pb"
                target.write_bytes(found[-1].read_bytes())  # one object on gs://, whole
                self.kept = str(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


# --- a live capture from a running process's server ----------------------------------------------------

CAPTURE_OPTIONS = {"host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0}


class CaptureFailed(RuntimeError):
    """The profiler server did not answer, or sent no trace (one line)."""


@contextlib.contextmanager
def _native_output_to(path: str):
    """The capture client (native) prints its progress to stdout and its connection errors, with a source
    trace, to stderr: both go to `path` while it runs; the caller names a failure in one line."""
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def capture(out: str, duration_ms: int, port: int, session: str, host: str, address: str = "localhost") -> str:
    """Trace the process serving jax.profiler at address:port for duration_ms, with the client TensorBoard's
    "capture profile" uses (xprof's), into `out/plugins/profile/<session>/<host>.xplane.pb` (gs:// too: written
    locally, then copied up whole). Returns the path written."""
    try:
        from xprof.convert import _pywrap_profiler_plugin as client
    except ImportError:
        raise UsageError("capture needs xprof: pip install 'tpuctl[profile]'") from None
    from etils import epath
    tmp = tempfile.mkdtemp(prefix="tpuctl-capture-")
    try:
        try:
            with _native_output_to(os.path.join(tmp, "client.log")):
                client.trace(f"{address}:{port}", tmp, "", False, int(duration_ms), 1, dict(CAPTURE_OPTIONS))
        except Exception as e:  # noqa: BLE001 - the client raises RuntimeError with gRPC's status text
            said = Path(tmp, "client.log").read_text(errors="replace")
            why = re.search(r"(UNAVAILABLE|DEADLINE_EXCEEDED|NOT_FOUND|UNIMPLEMENTED|INTERNAL)[^\n]*", said)
            raise CaptureFailed(f"the profiler server at {address}:{port} did not answer or sent no trace ("
                                + (why.group(0) if why else str(e).splitlines()[0] if str(e) else type(e).__name__)
                                + ")") from None
        found = sorted(Path(tmp).glob("plugins/profile/*/*.xplane.pb"))
        if not found:
            raise CaptureFailed(f"the profiler server at {address}:{port} sent no trace")
        dest = epath.Path(out.rstrip("/")) / "plugins" / "profile" / session
        dest.mkdir(parents=True, exist_ok=True)
        target = dest / f"{host}.xplane.pb"
        target.write_bytes(found[-1].read_bytes())
        return str(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
