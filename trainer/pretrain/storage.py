"""Local paths and gs:// through one small surface, for `prepare`: whole-file writes (a temp name renamed into
place locally; one object on gs://, which appears only when its upload completes), listings, reads."""
from __future__ import annotations

import builtins
import json
import os
from typing import Callable


def is_gs(p: str) -> bool:
    return p.startswith("gs://")


def gcs():
    import gcsfs
    fs = gcsfs.GCSFileSystem()  # one shared instance per process (fsspec caches it), listings cached in it:
    fs.invalidate_cache()       # pieces written by other hosts must show up
    return fs


def open(path: str, mode: str = "rb"):  # noqa: A001  (the builtin is not needed here)
    if is_gs(path):
        from etils import epath
        return epath.Path(path).open(mode)
    return builtins.open(path, mode)


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def write_whole(path: str, data: bytes | Callable) -> None:
    """The file appears whole or not at all: a temp name renamed into place locally; one object on gs://."""
    if is_gs(path):
        with open(path, "wb") as f:
            data(f) if callable(data) else f.write(data)
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with builtins.open(tmp, "wb") as f:
        data(f) if callable(data) else f.write(data)
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def rmtree(path: str) -> None:
    if is_gs(path):
        from etils import epath
        p = epath.Path(path)
        if p.exists():
            p.rmtree()
        return
    import shutil
    shutil.rmtree(path, ignore_errors=True)


def remove(path: str) -> None:
    try:
        if is_gs(path):
            from etils import epath
            epath.Path(path).unlink(missing_ok=True)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def listdir(path: str) -> set[str]:
    """Names in a folder (one listing, not one request per file: a corpus can have thousands of pieces)."""
    try:
        if is_gs(path):
            return {p.rsplit("/", 1)[-1] for p in gcs().ls(path[5:], detail=False, refresh=True)}
        return set(os.listdir(path))
    except FileNotFoundError:
        return set()


def size(path: str) -> int | None:
    try:
        if is_gs(path):
            from etils import epath
            return epath.Path(path).stat().length
        return os.path.getsize(path)
    except FileNotFoundError:
        return None
