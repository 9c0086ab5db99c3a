"""`tpuctl weights pull HANDLE --to gs://BUCKET/PREFIX`: download a Kaggle model once, stage it in GCS.

The download goes through `kagglehub` on the user's machine (its cache, its resume of a cut file, its md5
check); hosts later read only gs://. Staging copies each file of the model version under the prefix, then
writes MANIFEST (handle, version, each file's size and md5) last: a prefix without it is a pull that did
not finish, which the trainer refuses to load. Pulling the same version again compares the manifest
with the objects in the bucket and copies nothing; a pull that was cut short skips the files already
there with the right size and md5 and uploads the rest.

Credentials are kagglehub's: KAGGLE_USERNAME / KAGGLE_KEY, or ~/.kaggle/kaggle.json (KAGGLE_CONFIG_DIR).
tpuctl never reads, prints or stores them.
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from orchestrator.spec import UserError

MANIFEST = "tpuctl-manifest.json"  # the trainer (trainer/gemma/weights.py) requires it on gs:// paths
FRAMEWORKS = ("flax", "transformers", "jax", "keras", "pytorch", "tensorflow", "tfLite", "gemmaCpp", "other")
_SLUG = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_HANDLE_RE = re.compile(rf"({_SLUG})/({_SLUG})/({_SLUG})/({_SLUG})(?:/(\d+))?")


@dataclass(frozen=True)
class Handle:
    owner: str
    model: str
    framework: str
    variation: str
    version: int | None = None

    def __str__(self) -> str:
        base = f"{self.owner}/{self.model}/{self.framework}/{self.variation}"
        return base if self.version is None else f"{base}/{self.version}"

    @property
    def page(self) -> str:
        return f"kaggle.com/models/{self.owner}/{self.model}"

    # What the shared staging (pull/stage below, orchestrator/artifacts/datasets.py) asks of a handle.
    kind = "model"
    use_as = "load it with --weights"
    fields = "owner/model/framework/variation/version"

    @property
    def licence_name(self) -> str:
        return "Gemma" if self.model.startswith("gemma") else self.model

    def with_version(self, version: int) -> "Handle":
        return Handle(self.owner, self.model, self.framework, self.variation, int(version))

    def kagglehub_handle(self):
        from kagglehub import handle as kh
        return kh.parse_model_handle(str(self))

    def kagglehub_download(self, path: str | None = None) -> str:
        import kagglehub
        return kagglehub.model_download(str(self), path)


@dataclass
class PullResult:
    handle: str
    version: int
    dest: str
    files: int
    bytes: int
    uploaded: list[str] = field(default_factory=list)
    already_staged: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def parse_handle(handle: str) -> Handle:
    m = _HANDLE_RE.fullmatch(handle.strip().strip("/"))
    if not m:
        raise UserError(f"handle {handle!r}: expected OWNER/MODEL/FRAMEWORK/VARIATION[/VERSION], e.g. "
                        "google/gemma-2/flax/gemma2-2b-it/1")
    owner, model, fw, var, ver = m.groups()
    if fw not in FRAMEWORKS:
        raise UserError(f"handle {handle}: framework {fw!r} is not one of Kaggle's ({', '.join(FRAMEWORKS)}); "
                        "Gemma ships as flax or transformers")
    return Handle(owner, model, fw, var, int(ver) if ver else None)


def parse_dest(dest: str) -> tuple[str, str]:
    m = re.fullmatch(r"gs://([a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(?:/(.*))?", dest.strip())
    if not m or not (m.group(2) or "").strip("/"):
        raise UserError(f"--to {dest}: expected gs://BUCKET/PREFIX (a prefix of its own for this model)")
    return m.group(1), m.group(2).strip("/")


def _credential_source() -> str:
    from kagglehub import config
    if os.environ.get("KAGGLE_API_TOKEN") or (os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY")):
        return "the environment"
    try:
        creds = config.get_kaggle_credentials()
    except ValueError as e:  # a malformed kaggle.json: kagglehub names the file and the missing key
        raise UserError(f"Kaggle credentials: {e}; download a fresh kaggle.json from kaggle.com/settings "
                        "(API -> Create New Token)") from None
    if creds is None:
        raise UserError("no Kaggle credentials: set KAGGLE_USERNAME and KAGGLE_KEY, or put kaggle.json from "
                        "kaggle.com/settings (API -> Create New Token) in ~/.kaggle/")
    return config._get_kaggle_credentials_file()


@contextlib.contextmanager
def kaggle_endpoint(url: str | None):
    """Point kagglehub (kagglesdk) at another Kaggle API for the duration (it has no endpoint variable:
    its LOCALHOST environment's URL is the one we can set)."""
    if not url:
        yield
        return
    from kagglesdk import kaggle_env
    if not re.match(r"https?://", url):
        raise UserError(f"--kaggle-endpoint {url}: expected an http:// or https:// URL")
    old_env, old_url = os.environ.get("KAGGLE_API_ENVIRONMENT"), kaggle_env._env_to_endpoint[kaggle_env.KaggleEnv.LOCAL]
    os.environ["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
    kaggle_env._env_to_endpoint[kaggle_env.KaggleEnv.LOCAL] = url.rstrip("/")
    try:
        yield
    finally:
        kaggle_env._env_to_endpoint[kaggle_env.KaggleEnv.LOCAL] = old_url
        if old_env is None:
            os.environ.pop("KAGGLE_API_ENVIRONMENT", None)
        else:
            os.environ["KAGGLE_API_ENVIRONMENT"] = old_env


def _kaggle_errors(h, endpoint: str | None, source: str):
    """kagglehub / requests exceptions -> one line with the fix."""
    import requests
    from kagglehub import exceptions as kx

    @contextlib.contextmanager
    def ctx():
        try:
            yield
        except requests.HTTPError as e:
            code = e.response.status_code if e.response is not None else None
            if code == 401:
                raise UserError(f"Kaggle rejected the credentials from {source} (401): check KAGGLE_USERNAME / "
                                "KAGGLE_KEY or ~/.kaggle/kaggle.json (kaggle.com/settings -> API -> Create New "
                                "Token)") from None
            if code == 403:
                raise UserError(f"licence not accepted: accept the {h.licence_name} licence at {h.page}, then "
                                f"retry (Kaggle answered 403 for {h})") from None
            if code == 404:
                raise UserError(f"unknown handle {h} (Kaggle answered 404): check {h.fields} on "
                                f"{h.page}") from None
            raise UserError(f"Kaggle API error {code} for {h}; retry later") from None
        except kx.DataCorruptionError:
            raise UserError(f"a file of {h} failed its md5 check and was deleted; run the same pull again") from None
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            where = endpoint or "api.kaggle.com"
            kind = "the connection was cut mid-file" if isinstance(e, requests.exceptions.ChunkedEncodingError) \
                else "could not reach it"
            raise UserError(f"network failure talking to Kaggle ({where}): {kind}; run the same pull again "
                            "(finished files are kept and a cut file resumes)") from None
    return ctx()


def kagglehub_logs_to(stream) -> None:
    """kagglehub logs its progress lines to stdout; send them to `stream` instead."""
    import logging

    import kagglehub  # noqa: F401  (configures its logger)
    for handler in logging.getLogger("kagglehub").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(stream)


def resolve_version(h, endpoint: str | None = None):
    """The handle (a model's or a dataset's) with its version: as given, else the latest Kaggle reports."""
    if h.version is not None:
        return h
    source = _credential_source()
    from kagglehub import http_resolver
    from kagglehub.clients import build_kaggle_client
    with kaggle_endpoint(endpoint), _kaggle_errors(h, endpoint, source), build_kaggle_client() as client:
        version = http_resolver._get_current_version(client, h.kagglehub_handle())
    return h.with_version(int(version))


def download(h, endpoint: str | None = None, path: str | None = None) -> Path:
    """kagglehub's download of a versioned handle, or of one file of it (its cache; a cached complete copy
    is reused)."""
    source = _credential_source()
    with kaggle_endpoint(endpoint), _kaggle_errors(h, endpoint, source):
        return Path(h.kagglehub_download(path))


def _md5_b64_file(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return base64.b64encode(h.digest()).decode()


def local_manifest(h, folder: Path, only: Sequence[str] | None = None) -> dict:
    files = sorted(p for p in folder.rglob("*") if p.is_file()) if only is None else [folder / f for f in only]
    return {"handle": str(h), "version": h.version, "files": [
        {"path": p.relative_to(folder).as_posix(), "size": p.stat().st_size, "md5": _md5_b64_file(p)} for p in files]}


class Bucket:
    """The destination prefix through google-cloud-storage (STORAGE_EMULATOR_HOST points it at an emulator)."""

    def __init__(self, dest: str):
        from google.cloud import storage
        self.dest = dest.rstrip("/")
        self.bucket_name, self.prefix = parse_dest(dest)
        self.client = storage.Client()
        self.bucket = self.client.bucket(self.bucket_name)

    def check(self) -> None:
        from google.api_core import exceptions as gx
        try:
            if not self.bucket.exists():
                raise UserError(f"--to {self.dest}: bucket {self.bucket_name} does not exist; create it "
                                f"(gcloud storage buckets create gs://{self.bucket_name}) or pick another")
        except gx.Forbidden:
            raise UserError(f"--to {self.dest}: no access to bucket {self.bucket_name}; grant your account "
                            "storage.objects.create on it or pick another bucket") from None

    def blob(self, rel: str):
        return self.bucket.blob(f"{self.prefix}/{rel}")

    def manifest(self) -> dict | None:
        b = self.blob(MANIFEST)
        if not b.exists():
            return None
        return json.loads(b.download_as_bytes())

    def has(self, entry: dict) -> bool:
        b = self.bucket.get_blob(f"{self.prefix}/{entry['path']}")
        return b is not None and b.size == entry["size"] and b.md5_hash == entry["md5"]

    def upload(self, src: Path, entry: dict, on_bytes: Callable[[int], None]) -> None:
        b = self.blob(entry["path"])
        b.chunk_size = 8 << 20  # resumable upload in 8 MiB chunks; progress per chunk
        with open(src, "rb") as f:
            b.upload_from_file(_Counting(f, on_bytes), size=entry["size"], checksum="md5")

    def write_manifest(self, manifest: dict) -> None:
        self.blob(MANIFEST).upload_from_string(json.dumps(manifest, indent=1), content_type="application/json")


class _Counting:
    def __init__(self, f, on_bytes):
        self.f, self.on_bytes = f, on_bytes

    def read(self, n=-1):
        data = self.f.read(n)
        self.on_bytes(len(data))
        return data

    def __getattr__(self, name):
        return getattr(self.f, name)


def _staged(bucket: Bucket, h) -> dict | None:
    """The manifest at the prefix if it holds exactly this version, every object there and intact."""
    m = bucket.manifest()
    if m is None:
        return None
    if m.get("handle") != str(h):
        raise UserError(f"--to {bucket.dest} already holds {m.get('handle')}; stage {h} under another prefix")
    return m if all(bucket.has(e) for e in m["files"]) else None


def pull(handle: str, dest: str, *, endpoint: str | None = None, say: Callable[[str], None] = print,
         progress: bool = True) -> PullResult:
    """Download `handle` through kagglehub once and stage it under `dest` (see the module docstring)."""
    return stage(parse_handle(handle), dest, endpoint=endpoint, say=say, progress=progress, given=handle)


def stage(h, dest: str, *, endpoint: str | None = None, say: Callable[[str], None] = print, progress: bool = True,
          given: str | None = None, files: Sequence[str] | None = None) -> PullResult:
    """Stage a parsed handle (a model's here, a dataset's from orchestrator/artifacts/datasets.py) under `dest`: resolve
    its version, skip it if staged, download through kagglehub (the whole version, or only `files`), upload
    what the bucket lacks, write the manifest last."""
    bucket = Bucket(dest)
    bucket.check()
    if h.version is None:
        h = resolve_version(h, endpoint)
        say(f"resolved {given or h} to version {h.version}: {h}")
    m = _staged(bucket, h)
    if m is not None and (files is None or set(files) <= {e["path"] for e in m["files"]}):
        say(f"{h} is already staged at {bucket.dest} ({len(m['files'])} files); nothing copied")
        return PullResult(str(h), h.version, bucket.dest, len(m["files"]), sum(e["size"] for e in m["files"]),
                          already_staged=True)
    say(f"downloading {h} from Kaggle (kagglehub cache)")
    if files is None:
        folder = download(h, endpoint)
        manifest = local_manifest(h, folder)
    else:
        got = [download(h, endpoint, f) for f in files]
        folder = got[0].parents[len(Path(files[0]).parts) - 1]  # the version's folder in kagglehub's cache
        manifest = local_manifest(h, folder, [p.relative_to(folder).as_posix() for p in got])
    manifest["staged_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    todo = [e for e in manifest["files"] if not bucket.has(e)]
    total = sum(e["size"] for e in todo)
    say(f"staging {len(todo)} of {len(manifest['files'])} files ({total / 2**20:.1f} MiB) to {bucket.dest}")
    from tqdm import tqdm
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="upload", disable=not progress) as bar:
        for e in todo:
            bucket.upload(folder / e["path"], e, bar.update)
    bucket.write_manifest(manifest)  # last: until now the prefix is visibly unfinished
    say(f"staged {h} at {bucket.dest}; {h.use_as} {bucket.dest}")
    return PullResult(str(h), h.version, bucket.dest, len(manifest["files"]),
                      sum(e["size"] for e in manifest["files"]), uploaded=[e["path"] for e in todo])
