"""`make setup`'s uv: runs uv with pip's configuration (files and PIP_* variables) as uv's environment.

uv installs the project's pins in seconds where pip takes over a minute, but reads none of pip's configuration: the
index, the extra indexes and find-links (only those that exist here: pip warns about a missing file:// location,
uv fails), the constraints and the CA file are handed over. The same translation as orchestrator/host/bootstrap.sh
makes on the hosts.

    VENV/bin/python tools/uv_env.py VENV/bin/uv pip install ...    (pip's settings: that python's pip)
"""
import os
import subprocess
import sys


def pip_settings(python: str) -> dict[str, str]:
    """key -> the last value pip's configuration gives it (`pip config list`: global/user/site files, then env)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    got: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition("=")
        got[key.rsplit(".", 1)[-1]] = value.strip().strip("'\"")
    return got


def existing(locations: str) -> list[str]:
    keep = []
    for u in locations.split():
        path = u[len("file://"):] if u.startswith("file://") else u if u.startswith("/") else None
        if path is None or os.path.exists(path):
            keep.append(u)
    return keep


def uv_env(python: str) -> dict[str, str]:
    s = pip_settings(python)
    # pip picks the best version across every index; uv by default takes the first index that has the package
    env = {"UV_NATIVE_TLS": "1", "UV_NO_PROGRESS": "1", "UV_INDEX_STRATEGY": "unsafe-best-match"}
    if s.get("index-url"):
        env["UV_DEFAULT_INDEX"] = s["index-url"]
    if existing(s.get("extra-index-url", "")):
        env["UV_INDEX"] = " ".join(existing(s["extra-index-url"]))
    if existing(s.get("find-links", "")):
        env["UV_FIND_LINKS"] = ",".join(existing(s["find-links"]))
    if s.get("constraint") and os.path.isfile(s["constraint"]):
        env["UV_CONSTRAINT"] = s["constraint"]
    if s.get("cert") and os.path.isfile(s["cert"]):
        env["SSL_CERT_FILE"] = s["cert"]
    return env


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python tools/uv_env.py UV ARGS...")
    os.environ.update({k: v for k, v in uv_env(sys.executable).items() if k not in os.environ})
    os.execv(sys.argv[1], sys.argv[1:])
