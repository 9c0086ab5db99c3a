"""A local stand-in for Kaggle's model and dataset APIs, answering the real `kagglehub` client over HTTP.

Wire protocol (as kagglehub 1.0.3 / kagglesdk speak it): `POST /api/v1/models.ModelApiService/<Method>` with a
camelCase JSON body and HTTP basic auth (username, API key):
- GetModelInstance {ownerSlug, modelSlug, framework, instanceSlug} -> {"versionNumber": N, ...} (the latest);
- ListModelInstanceVersionFiles {..., versionNumber, pageSize, pageToken} -> {"files": [{name, size}], "nextPageToken"};
- DownloadModelInstanceVersion {..., versionNumber, path?} -> 302 to a signed blob URL (GET, no auth) serving the
  file, or a tar.gz of the whole version without `path`, with Content-Length, Accept-Ranges: bytes (kagglehub
  resumes a cut download with a Range request) and X-Goog-Hash: md5=... (kagglehub checks it).
Datasets (kagglehub.dataset_download; kagglesdk's DatasetApiClient, `POST /api/v1/datasets.DatasetApiService/...`):
- GetDataset {ownerSlug, datasetSlug} -> {"currentVersionNumber": N, ...} (kagglehub's _get_current_version);
- DownloadDataset {ownerSlug, datasetSlug, datasetVersionNumber, fileName?} -> 302 to a signed URL serving the
  one file named by fileName, or a zip of the whole version without it (kagglehub unpacks it in its cache).
Errors are JSON `{"code": C, "message": M}` with that HTTP status, which kagglesdk raises as HTTPError.

Models live on disk as ROOT/<owner>/<model>/<framework>/<variation>/<version>/<files>, datasets as
ROOT/datasets/<owner>/<dataset>/<version>/<files>. A model listed in
`consent` needs its licence accepted by the user (403 otherwise), as Gemma does on Kaggle.
Injectable faults (FakeKaggle.inject): "401", "403", "404", "500" on the next API calls, "cut" = the next blob
download closes the connection half-way through the body.

    python -m infra.fake_kaggle serve --root DIR [--port P] [--user NAME:KEY] [--consent OWNER/MODEL:NAME]
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import socket
import tarfile
import threading
import zipfile
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

API = "/api/v1/models.ModelApiService/"
DATASET_API = "/api/v1/datasets.DatasetApiService/"
DATASETS = "datasets"  # the folder under ROOT that holds datasets
FRAMEWORK_PREFIX = "MODEL_FRAMEWORK_"
PAGE_SIZE_MAX = 25


def _md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class FakeKaggle:
    """The server (a thread in this process): start() -> base URL; stop(); inject(); calls (the API log)."""

    def __init__(self, root: str | os.PathLike, users: dict[str, str], consent: dict[str, set[str]] | None = None):
        self.root = Path(root)
        self.users = dict(users)
        self.consent = {k: set(v) for k, v in (consent or {}).items()}  # "owner/model" -> users who accepted
        self.faults: list[str] = []
        self.calls: list[str] = []  # "Method" for API calls, "GET path" for blob downloads
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    def start(self, port: int = 0) -> str:
        fake = self

        class Handler(_Handler):
            kaggle = fake

        self.server = _Server(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def inject(self, kind: str, times: int = 1) -> None:
        if kind not in ("401", "403", "404", "500", "cut"):
            raise ValueError(f"unknown fault {kind!r}")
        with self.lock:
            self.faults.extend([kind] * times)

    def _take(self, kinds: tuple[str, ...]) -> str | None:
        with self.lock:
            for i, k in enumerate(self.faults):
                if k in kinds:
                    return self.faults.pop(i)
        return None

    def version_dir(self, req: dict, version: int | None = None) -> Path:
        fw = str(req.get("framework", "")).removeprefix(FRAMEWORK_PREFIX).lower()
        base = self.root / req.get("ownerSlug", "") / req.get("modelSlug", "") / fw / req.get("instanceSlug", "")
        return base if version is None else base / str(version)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a client that hung up after a cut: not news
        pass


class _ApiError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _Handler(BaseHTTPRequestHandler):
    kaggle: FakeKaggle
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet: tests read .calls instead
        pass

    # ---- API
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path = self.path.split("?")[0]
        method = path.removeprefix(DATASET_API if path.startswith(DATASET_API) else API)
        k = self.kaggle
        k.calls.append(method)
        try:
            if not path.startswith((API, DATASET_API)):
                raise _ApiError(404, f"no such service: {self.path}")
            req = json.loads(body or b"{}")
            user = self._auth()
            fault = k._take(("401", "403", "404", "500"))
            if fault == "401":
                raise _ApiError(401, "Unauthenticated")
            if fault == "403":
                raise _ApiError(403, self._consent_message(req))
            if fault == "404":
                raise _ApiError(404, "Not found")
            if fault == "500":
                raise _ApiError(500, "Internal error")
            if path.startswith(DATASET_API):
                return self._dataset(method, req)
            inst = k.version_dir(req)
            if not inst.is_dir():
                raise _ApiError(404, "Not found")
            owner_model = f"{req.get('ownerSlug')}/{req.get('modelSlug')}"
            if owner_model in k.consent and user not in k.consent[owner_model]:
                raise _ApiError(403, self._consent_message(req))
            versions = sorted(int(p.name) for p in inst.iterdir() if p.is_dir() and p.name.isdigit())
            if method == "GetModelInstance":
                return self._json(200, {"slug": req.get("instanceSlug"), "framework": req.get("framework"),
                                        "versionNumber": versions[-1] if versions else 0})
            vdir = k.version_dir(req, req.get("versionNumber"))
            if not vdir.is_dir():
                raise _ApiError(404, "Not found")
            files = sorted(str(p.relative_to(vdir)) for p in vdir.rglob("*") if p.is_file())
            if method == "ListModelInstanceVersionFiles":
                size = min(int(req.get("pageSize") or PAGE_SIZE_MAX), PAGE_SIZE_MAX)
                start = int(req.get("pageToken") or 0)
                page = files[start:start + size]
                nxt = str(start + size) if start + size < len(files) else ""
                return self._json(200, {"files": [{"name": f, "size": (vdir / f).stat().st_size} for f in page],
                                        "nextPageToken": nxt})
            if method == "DownloadModelInstanceVersion":
                path = req.get("path")
                if path and path not in files:
                    raise _ApiError(404, "Not found")
                rel = vdir.relative_to(k.root).as_posix()
                target = f"/blobs/{rel}/{urllib.parse.quote(path)}" if path else f"/archives/{rel}.tar.gz"
                self.send_response(302)
                self.send_header("Location", f"{k.url}{target}?token=signed")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            raise _ApiError(404, f"no such method: {method}")
        except _ApiError as e:
            self._json(e.code, {"code": e.code, "message": str(e)})

    def _dataset(self, method: str, req: dict) -> None:
        k = self.kaggle
        base = k.root / DATASETS / str(req.get("ownerSlug", "")) / str(req.get("datasetSlug", ""))
        if not base.is_dir() or k.root / DATASETS not in base.resolve().parents:
            raise _ApiError(404, "Not found")
        versions = sorted(int(p.name) for p in base.iterdir() if p.is_dir() and p.name.isdigit())
        if method == "GetDataset":
            return self._json(200, {"ownerSlug": req.get("ownerSlug"), "datasetSlug": req.get("datasetSlug"),
                                    "currentVersionNumber": versions[-1] if versions else 0})
        if method != "DownloadDataset":
            raise _ApiError(404, f"no such method: {method}")
        version = req.get("datasetVersionNumber") or (versions[-1] if versions else 0)
        vdir = base / str(version)
        if not vdir.is_dir():
            raise _ApiError(404, "Not found")
        name = req.get("fileName")
        if name and not (vdir / name).is_file():
            raise _ApiError(404, "Not found")
        rel = vdir.relative_to(k.root).as_posix()
        target = f"/blobs/{rel}/{urllib.parse.quote(name)}" if name else f"/archives/{rel}.zip"
        self.send_response(302)
        self.send_header("Location", f"{k.url}{target}?token=signed")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _auth(self) -> str:
        h = self.headers.get("Authorization", "")
        if not h.startswith("Basic "):
            raise _ApiError(401, "Unauthenticated")
        user, _, key = base64.b64decode(h[6:]).decode().partition(":")
        if self.kaggle.users.get(user) != key:
            raise _ApiError(401, "Unauthenticated")
        return user

    @staticmethod
    def _consent_message(req: dict) -> str:
        return (f"Permission denied: you must accept the terms of use of the model at "
                f"https://www.kaggle.com/models/{req.get('ownerSlug')}/{req.get('modelSlug')} to access it")

    def _json(self, code: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # ---- signed blob URLs (no auth, like a GCS signed URL)
    def do_GET(self):
        k = self.kaggle
        path = urllib.parse.unquote(self.path.split("?")[0])
        k.calls.append(f"GET {path}")
        if path.startswith("/blobs/"):
            f = k.root / path.removeprefix("/blobs/")
            if not f.is_file() or k.root not in f.resolve().parents:
                return self._json(404, {"code": 404, "message": "Not found"})
            data = f.read_bytes()
        elif path.startswith("/archives/") and path.endswith(".tar.gz"):
            vdir = k.root / path.removeprefix("/archives/").removesuffix(".tar.gz")
            if not vdir.is_dir():
                return self._json(404, {"code": 404, "message": "Not found"})
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:gz") as tar:
                for p in sorted(vdir.rglob("*")):
                    if p.is_file():
                        tar.add(p, arcname=str(p.relative_to(vdir)))
            data = buf.getvalue()
        elif path.startswith("/archives/") and path.endswith(".zip"):  # a dataset version, as Kaggle zips it
            vdir = k.root / path.removeprefix("/archives/").removesuffix(".zip")
            if not vdir.is_dir():
                return self._json(404, {"code": 404, "message": "Not found"})
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
                for p in sorted(vdir.rglob("*")):
                    if p.is_file():
                        z.write(p, arcname=str(p.relative_to(vdir)))
            data = buf.getvalue()
        else:
            return self._json(404, {"code": 404, "message": "Not found"})
        start = 0
        rng = self.headers.get("Range", "")
        if rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0] or 0)
        body = data[start:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("X-Goog-Hash", f"md5={_md5_b64(data)}")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if k._take(("cut",)) and len(body) > 1:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        self.wfile.write(body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infra.fake_kaggle", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve ROOT until interrupted")
    s.add_argument("--root", required=True)
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--user", action="append", default=[], metavar="NAME:KEY")
    s.add_argument("--consent", action="append", default=[], metavar="OWNER/MODEL:NAME",
                   help="NAME has accepted the licence of OWNER/MODEL (a model named here refuses everyone else)")
    a = p.parse_args(argv)
    consent: dict[str, set[str]] = {}
    for c in a.consent:
        model, _, user = c.rpartition(":")
        consent.setdefault(model, set()).add(user)
    fake = FakeKaggle(a.root, dict(u.split(":", 1) for u in a.user), consent)
    print(fake.start(a.port), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
