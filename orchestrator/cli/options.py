"""What every `tpuctl` command shares: the error wrapper, the common options, the live status line."""
from __future__ import annotations

import difflib
import functools
import sys
import time

import click

from orchestrator.spec import UserError


def table(headers: list[str], rows: list[list]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def local_option(f):
    return click.option("--local", is_flag=True, default=False,
                        help="Local mode: slices on this machine (the Cloud TPU API stand-in, started in the "
                             "background and reused, sshd hosts on loopback, the GCS emulator). No cloud account. "
                             "A recorded slice is found wherever it lives without it.")(f)


class TpuctlError(click.ClickException):
    """A user-facing error: one clear line naming what is wrong and how to fix it, exit code 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class PassThrough(click.Command):
    """A command whose trailing COMMAND is handed on as it is (`tpuctl run NAME [OPTIONS] -- pretrain ...`).

    Options this command does not know are not handed on when they come before COMMAND: a mistyped or retired
    option there (`tpuctl run NAME --api-endpoint URL -- pretrain`) would otherwise become the start of the
    trainer's command line and fail there with the trainer's error. Before COMMAND (the first `--`, or the first
    positional word after this command's own arguments) every option must be one of ours."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("context_settings", {})["ignore_unknown_options"] = True
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        self.check_options(ctx, args)
        return super().parse_args(ctx, args)

    def check_options(self, ctx: click.Context, args: list[str]) -> None:
        takes_value: dict[str, bool] = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Option):
                for opt in (*param.opts, *param.secondary_opts):
                    takes_value[opt] = not (param.is_flag or param.count)
        own_args = sum(1 for p in self.params if isinstance(p, click.Argument) and p.nargs == 1)
        i = 0
        while i < len(args):
            a = args[i]
            if a == "--":
                return
            if not a.startswith("-") or a == "-":
                if own_args == 0:
                    return  # COMMAND starts here
                own_args -= 1
            else:
                opt = a.split("=", 1)[0]
                if opt not in takes_value and not a.startswith("--") and a[:2] in takes_value:
                    opt = a[:2]  # -a v4-8 written as -av4-8
                if opt not in takes_value:
                    longs = [o for o in takes_value if o.startswith("--")]
                    near = difflib.get_close_matches(opt, longs, n=1, cutoff=0.6)
                    hint = f" (did you mean {near[0]}?)" if near else ""
                    raise TpuctlError(f"tpuctl {ctx.info_name}: no such option {opt}{hint}; options for the command "
                                      f"it runs go after --: `tpuctl {ctx.info_name} --help` lists its own")
                if takes_value[opt] and "=" not in a and a == opt:
                    i += 1  # its value, whatever it looks like
            i += 1


def _user_errors() -> tuple[type, ...]:
    """The exceptions that carry one line for the user. Modules not loaded yet cannot have raised theirs."""
    kinds: list[type] = [UserError]
    for mod, name in (("orchestrator.jobs.launch", "LaunchError"), ("orchestrator.access.hosts", "HostError"),
                      ("orchestrator.jobs.bundle", "BundleError")):
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
