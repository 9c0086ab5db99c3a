"""Reaching a worker through a proxy command, with OpenSSH ProxyCommand semantics.

The command runs through the shell (`sh -c 'exec CMD'`, as OpenSSH runs its ProxyCommand); its stdin and stdout
carry the SSH stream. `%h` and `%p` are the worker's address and SSH port, `%r` the remote user, `%%` a percent
sign. A bastion (`ssh -W %h:%p bastion`), a SOCKS hop (`nc -X 5 -x proxy:1080 %h %p`) or Cloud IAP TCP forwarding
(`iap_command`) all fit. Each connection gets a proxy process of its own, ended when the connection closes.
"""
from __future__ import annotations

import collections
import os
import re
import select
import signal
import socket
import subprocess
import threading
import time

import paramiko
from paramiko.ssh_exception import ProxyCommandFailure

ENV = "TPUCTL_SSH_PROXY_COMMAND"
_TOKEN = re.compile(r"%(.)?", re.S)
TOKENS = {"h": "the worker's address", "p": "its SSH port", "r": "the remote user", "%": "a literal %"}


class ProxyError(ValueError):
    """One line: what is wrong with the proxy command."""


def check(template: str, what: str = "--ssh-proxy-command") -> str:
    """The template as given, or ProxyError naming an unknown %-token."""
    if not template.strip():
        raise ProxyError(f"{what} is empty: give a command such as \"ssh -W %h:%p bastion\"")
    for m in _TOKEN.finditer(template):
        if m.group(1) not in TOKENS:
            tok = "%" + (m.group(1) or "")
            raise ProxyError(f"{what} {template!r}: unknown token {tok!r}; use %h (address), %p (port), "
                             "%r (user) or %% (a literal %)")
    return template


def expand(template: str, host: str, port: int, user: str) -> str:
    values = {"h": host, "p": str(port), "r": user, "%": "%"}
    return _TOKEN.sub(lambda m: values[m.group(1)], check(template))


def iap_command(vm: str, zone: str, project: str) -> str:
    """The IAP TCP forwarding hop gcloud itself uses for `gcloud compute ssh --tunnel-through-iap` (and
    `gcloud compute tpus tpu-vm ssh --tunnel-through-iap`, with the worker VM's name from its guest attributes):
    start-iap-tunnel to the VM's port %p, the SSH stream on stdin/stdout."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", vm or ""):
        raise ProxyError(f"cannot build the IAP command: the worker VM name {vm!r} is not a VM name")
    return (f"gcloud compute start-iap-tunnel {vm} %p --listen-on-stdin --zone={zone} --project={project} "
            "--verbosity=warning")


class Proxy(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, told apart when it fails: the proxy's end of stream is an error at once (paramiko's
    own waits out the banner timeout), its stderr is kept (last lines) and drained so it never blocks, and what
    it printed before the SSH banner is kept for the message."""

    def __init__(self, command: str):  # noqa: super().__init__ would split the command itself, without a shell
        self.command = command
        self.cmd = ["/bin/sh", "-c", "exec " + command]
        self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, bufsize=0, start_new_session=True)
        self.timeout = None
        self.head = b""        # the first bytes it sent: an SSH banner, or what it printed instead
        self.stderr = collections.deque(maxlen=20)
        self._drain = threading.Thread(target=self._read_stderr, daemon=True, name="ssh-proxy-stderr")
        self._drain.start()

    def _read_stderr(self) -> None:
        for line in iter(self.process.stderr.readline, b""):
            self.stderr.append(line.decode(errors="replace").rstrip())

    def recv(self, size):
        buf = b""
        start = time.time()
        try:
            while len(buf) < size:
                wait = None
                if self.timeout is not None:
                    left = self.timeout - (time.time() - start)
                    if left <= 0:
                        raise socket.timeout()
                    wait = left
                r, _, _ = select.select([self.process.stdout], [], [], wait)
                if r:
                    chunk = os.read(self.process.stdout.fileno(), size - len(buf))
                    if not chunk:
                        if buf:
                            break
                        raise ProxyCommandFailure(self.command, "the proxy command closed its output")
                    if len(self.head) < 256:
                        self.head += chunk[:256 - len(self.head)]
                    buf += chunk
            return buf
        except socket.timeout:
            if buf:
                return buf
            raise
        except OSError as e:
            raise ProxyCommandFailure(self.command, e.strerror or str(e)) from None

    def send(self, content):
        try:
            self.process.stdin.write(content)
        except OSError as e:
            raise ProxyCommandFailure(self.command, e.strerror or str(e)) from None
        return len(content)

    def _read_rest(self) -> None:
        """What an exited proxy printed that paramiko did not read (it may have failed writing its own banner)."""
        try:
            while len(self.head) < 256 and select.select([self.process.stdout], [], [], 0)[0]:
                chunk = os.read(self.process.stdout.fileno(), 256 - len(self.head))
                if not chunk:
                    return
                self.head += chunk
        except (OSError, ValueError):
            pass

    def problem(self) -> str | None:
        """Why the proxy, not the host, failed the connection (None when it still looks healthy)."""
        if self.process.poll() is not None:
            self._read_rest()
        if self.head and not any(l.startswith(b"SSH-") for l in self.head.splitlines()):
            got = self.head.decode(errors="replace").strip().splitlines()[0][:120]
            how = f"printed {got!r} instead of an SSH banner"
        elif self.process.poll() is not None:
            self._drain.join(1)
            how = f"exited {self.process.returncode}"
        else:
            return None
        self._drain.join(0.5)
        err = " | ".join(l for l in list(self.stderr)[-3:] if l.strip()) or "nothing on stderr"
        return f"the SSH proxy command {how}: `{self.command}` (stderr: {err})"

    @property
    def fatal(self) -> bool:
        """Waiting cannot help: the command cannot run (126, 127), ended as if done (0), or talks something else
        than SSH. A proxy that fails otherwise (a bastion or tunnel that cannot reach the VM yet) is retried."""
        return (self.process.poll() in (0, 126, 127)) or bool(
            self.head and not any(l.startswith(b"SSH-") for l in self.head.splitlines()))

    def close(self):
        self._read_rest()  # kept for problem(): the pipes go below
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait(timeout=5)
        for f in (self.process.stdin, self.process.stdout):
            try:
                f.close()
            except OSError:
                pass
