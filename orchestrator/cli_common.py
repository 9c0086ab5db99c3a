"""What every `tpuctl` command shares: the error wrapper, the common options, the live status line."""
from __future__ import annotations

import functools
import sys
import time

import click

from orchestrator.spec import UserError


def local_option(f):
    return click.option("--local", is_flag=True, default=False,
                        help="Local mode: slices on this machine (the Cloud TPU API stand-in, started in the "
                             "background and reused, sshd hosts on loopback, the GCS emulator). No cloud account. "
                             "A recorded slice is found wherever it lives without it.")(f)


class TpuctlError(click.ClickException):
    """A user-facing error: one clear line naming what is wrong and how to fix it, exit code 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


def _user_errors() -> tuple[type, ...]:
    """The exceptions that carry one line for the user. Modules not loaded yet cannot have raised theirs."""
    kinds: list[type] = [UserError]
    for mod, name in (("orchestrator.launch", "LaunchError"), ("orchestrator.hosts", "HostError"),
                      ("orchestrator.bundle", "BundleError")):
        if mod in sys.modules:
            kinds.append(getattr(sys.modules[mod], name))
    return tuple(kinds)


def errors(fn):
    """What every tpuctl command wraps itself in: a user error -> one line and exit 1; an interrupted `up`
    (it says what it cleaned up) or Ctrl-C -> one line and exit 130; never a traceback."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("Error: interrupted", err=True)
            sys.exit(130)
        except Exception as e:
            if "orchestrator.slices" in sys.modules and isinstance(e, sys.modules["orchestrator.slices"].Interrupted):
                click.echo(f"Error: {' '.join(str(e).split())}", err=True)
                sys.exit(130)
            if isinstance(e, _user_errors()):
                raise TpuctlError(str(e)) from None
            raise
    return wrapper


def api_options(f):
    f = click.option("--project", metavar="P",
                     help="Google Cloud project id. Default: TPUCTL_PROJECT, GOOGLE_CLOUD_PROJECT, gcloud's "
                          "configured project, then the credentials' project; 'local-project' with --local.")(f)
    f = local_option(f)
    f = click.option("--api-endpoint", metavar="URL",
                     help="Any endpoint speaking the Cloud TPU v2 API (regional/private endpoint, proxy, stand-in). "
                          "http:// URLs use anonymous credentials, others Application Default Credentials. "
                          "Default: env TPUCTL_TPU_API_ENDPOINT, else tpu.googleapis.com.")(f)
    return f


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout (for scripts) instead of text.")(f)


class StatusLine:
    """A live status line on stderr: a spinner on a terminal, one line per change otherwise (logs, CI)."""

    def __init__(self, quiet: bool = False):
        self.quiet, self.last, self.t0 = quiet, None, time.monotonic()
        self.tty = sys.stderr.isatty()
        self._status = None

    def __enter__(self):
        if self.tty and not self.quiet:
            from rich.console import Console
            self._status = Console(stderr=True).status("starting")
            self._status.__enter__()
        return self

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.__exit__(*exc)

    def __call__(self, msg: str) -> None:
        if self.quiet:
            return
        if self._status is not None:
            self._status.update(f"{msg}  [{time.monotonic() - self.t0:.0f}s]")
        elif msg != self.last:
            click.echo(f"  {msg}", err=True)
        self.last = msg

    def note(self, msg: str) -> None:
        """A line that stays (above the spinner)."""
        if self._status is not None:
            self._status.console.print(msg, markup=False, highlight=False)
        else:
            click.echo(msg, err=True)
