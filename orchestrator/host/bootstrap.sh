#!/usr/bin/env bash
# What a host runs to get a Python environment for a tpuctl bundle; idempotent, safe to rerun.
#
# Two layers, so that a code change never reinstalls jax:
#   ROOT/deps/KEY/   a venv with the pinned dependencies (KEY = hash of the dependency list + flavour)
#   ROOT/app/HASH/   the project wheel, installed --no-deps (HASH = the bundle's content hash)
# Each layer is built once (under a lock) and marked complete; a rerun with the same keys does nothing.
#
# It finds out itself whether the host has TPU devices (/dev/accel*, /dev/vfio/N) and installs jax[tpu]
# there, plain jax elsewhere. It brings a Python the pinned jax supports (>= 3.11) when the image's is
# older (TPU VM images ship 3.10): `uv python install`. With --wheelhouse it installs only from that
# directory (a wheelhouse shared on the machine) through a shared uv cache, so a second host on the same
# machine hard-links files instead of downloading them.
#
# usage: bootstrap.sh --root DIR --deps-key KEY --reqs FILE --app-hash HASH --wheel FILE
#                     [--deps-root DIR] [--wheelhouse DIR] [--uv-cache DIR] [--python PATH]
# --deps-root: where the dependency layer lives (default ROOT/deps); hosts of one machine can share it.
set -euo pipefail
STEP="reading arguments"
trap 'echo "error: bootstrap.sh on $(hostname): step \"$STEP\" failed (line $LINENO: $BASH_COMMAND)" >&2' ERR
T0=$(date +%s.%N)
ROOT= KEY= REQS= APPHASH= WHEEL= WH= UVCACHE= PY= DEPSROOT=
while [ $# -gt 0 ]; do
  case "$1" in
    --root) ROOT=$2; shift 2;;
    --deps-key) KEY=$2; shift 2;;
    --reqs) REQS=$2; shift 2;;
    --app-hash) APPHASH=$2; shift 2;;
    --wheel) WHEEL=$2; shift 2;;
    --wheelhouse) WH=$2; shift 2;;
    --uv-cache) UVCACHE=$2; shift 2;;
    --python) PY=$2; shift 2;;
    --deps-root) DEPSROOT=$2; shift 2;;
    *) echo "error: bootstrap.sh: unknown argument $1" >&2; exit 2;;
  esac
done
for v in ROOT KEY REQS APPHASH WHEEL; do
  [ -n "${!v}" ] || { echo "error: bootstrap.sh: --$(echo $v | tr A-Z a-z) is required" >&2; exit 2; }
done
DEPSROOT=${DEPSROOT:-$ROOT/deps}
mkdir -p "$DEPSROOT" "$ROOT/app"
# Every path absolute from here on: a relative one means something else inside `ln -s`, uv and venvs.
ROOT=$(cd "$ROOT" && pwd -P)
DEPSROOT=$(cd "$DEPSROOT" && pwd -P)
for v in REQS WHEEL WH UVCACHE; do
  [ -n "${!v}" ] && [ "${!v#/}" = "${!v}" ] && printf -v "$v" '%s/%s' "$PWD" "${!v}"
done
TOOLS=$(dirname "$DEPSROOT")/tools  # uv and pythons, beside the dependency layer (shared with it)
mkdir -p "$TOOLS"
export UV_CACHE_DIR=${UVCACHE:-$ROOT/uv-cache} UV_NO_PROGRESS=1 UV_PYTHON_INSTALL_DIR=$TOOLS/python
[ -n "$WH" ] && export UV_PYTHON_DOWNLOADS=never  # local mode: nothing from the internet but the index

log() { echo "bootstrap: $*"; }
step() { STEP=$*; }

# ---- the package index as the image's pip is configured (a mirror, extra indexes, a CA bundle): uv
# reads no pip.conf, so hand it the same settings. uv also trusts the system's CA store, as pip does.
export UV_NATIVE_TLS=1
pip_setting() {  # the last value pip's configuration gives KEY (global/user/site files and PIP_* env)
  local py=$1 key=$2
  "$py" -m pip config list 2>/dev/null | sed -n "s/^[a-z:.]*\.$key='\(.*\)'$/\1/p" | tail -1
}
existing_urls() {  # drop file:// locations that do not exist here (pip only warns about them; uv fails)
  local u out=()
  for u in $1; do
    case "$u" in file://*) [ -e "${u#file://}" ] || continue;; /*) [ -e "$u" ] || continue;; esac
    out+=("$u")
  done
  echo "${out[*]:-}"
}
use_pip_config() {
  local py=$1 v
  [ -n "$py" ] && "$py" -m pip --version >/dev/null 2>&1 || return 0
  v=$(pip_setting "$py" index-url); [ -n "$v" ] && [ -z "${UV_DEFAULT_INDEX:-}" ] && export UV_DEFAULT_INDEX=$v
  v=$(existing_urls "$(pip_setting "$py" extra-index-url)")
  [ -n "$v" ] && [ -z "${UV_INDEX:-}" ] && export UV_INDEX=$v
  # pip takes the best version across all its indexes; uv, by default, only the first index that has the package
  # (a pin found on an extra index alone would fail)
  [ -n "$v" ] && [ -z "${UV_INDEX_STRATEGY:-}" ] && export UV_INDEX_STRATEGY=unsafe-best-match
  v=$(existing_urls "$(pip_setting "$py" find-links)")
  [ -n "$v" ] && [ -z "${UV_FIND_LINKS:-}" ] && export UV_FIND_LINKS=${v// /,}
  v=$(pip_setting "$py" constraint); [ -n "$v" ] && [ -f "$v" ] && export UV_CONSTRAINT=$v
  v=$(pip_setting "$py" cert); [ -n "$v" ] && [ -f "$v" ] && [ -z "${SSL_CERT_FILE:-}" ] && export SSL_CERT_FILE=$v
  return 0
}

# ---- accelerator flavour
step "detecting the accelerator"
FLAVOUR=cpu
if ls /dev/accel* >/dev/null 2>&1 || ls /dev/vfio/[0-9]* >/dev/null 2>&1; then FLAVOUR=tpu; fi

# ---- a Python >= 3.11
py_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1; }
find_python() {
  if [ -n "$PY" ] && py_ok "$PY"; then echo "$PY"; return; fi
  for c in python3.13 python3.12 python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1 && py_ok "$(command -v "$c")"; then command -v "$c"; return; fi
  done
}

# ---- uv: on PATH, already unpacked, from the wheelhouse, or installed (real hosts have internet)
find_uv() {
  if command -v uv >/dev/null 2>&1; then command -v uv; return; fi
  if [ -x "$TOOLS/uv" ]; then echo "$TOOLS/uv"; return; fi
  local any_py; any_py=$(command -v python3 || true)
  [ -n "$any_py" ] || any_py=$PY
  if [ -n "$WH" ] && ls "$WH"/uv-*.whl >/dev/null 2>&1 && [ -n "$any_py" ]; then
    "$any_py" - "$(ls "$WH"/uv-*.whl | head -1)" "$TOOLS/uv" <<'EOF'
import os, sys, uuid, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith("/scripts/uv"))
    tmp = "%s.tmp-%s" % (dest, uuid.uuid4().hex)  # hosts of one machine share this dir (and pid numbers)
    with z.open(name) as src, open(tmp, "wb") as out:
        out.write(src.read())
os.chmod(tmp, 0o755)
os.replace(tmp, dest)
EOF
    [ -x "$TOOLS/uv" ] && { echo "$TOOLS/uv"; return; }
  fi
  if [ -z "$WH" ]; then
    if [ -n "$any_py" ] && "$any_py" -m pip install -q --target "$TOOLS/uvpkg" uv >/dev/null 2>&1; then
      ln -sf "$TOOLS/uvpkg/bin/uv" "$TOOLS/uv"; echo "$TOOLS/uv"; return
    fi
    if command -v curl >/dev/null 2>&1 &&
       curl -LsSf https://astral.sh/uv/install.sh | env UV_INSTALL_DIR="$TOOLS" UV_NO_MODIFY_PATH=1 sh >/dev/null 2>&1; then
      echo "$TOOLS/uv"; return
    fi
  fi
}

step "reading the host's pip configuration"
[ -z "$WH" ] && use_pip_config "$(command -v python3 || echo "$PY")"
step "installing uv"
UV=$(find_uv || true)
[ -n "$UV" ] && [ ! -x "$UV" ] && { echo "error: bootstrap.sh on $(hostname): uv at $UV is not executable" >&2; exit 3; }
step "finding a Python >= 3.11"
PYTHON=$(find_python || true)
if [ -z "$PYTHON" ]; then
  HAVE=$(command -v python3 >/dev/null 2>&1 && python3 -c 'import platform; print(platform.python_version())' 2>/dev/null || echo none)
  FIX="install python3.11 or newer in the host image (or pass its path as --python), or give the host internet access to the Python downloads"
  [ -n "$UV" ] || { echo "error: bootstrap.sh on $(hostname): no Python >= 3.11 (python3 here: $HAVE) and no uv to fetch one: $FIX" >&2; exit 3; }
  log "no Python >= 3.11 here (python3: $HAVE): installing 3.11 with uv"
  if ! OUT=$("$UV" python install -q 3.11 2>&1) || ! PYTHON=$("$UV" python find 3.11 2>/dev/null); then
    echo "error: bootstrap.sh on $(hostname): no Python >= 3.11 (python3 here: $HAVE) and uv could not fetch one ($(echo "$OUT" | tail -1)): $FIX" >&2
    exit 3
  fi
fi

# ---- layer 1: dependencies, once per KEY
DEPS="$DEPSROOT/$KEY"
DEPS_STATE=cached
step "installing the dependencies into $DEPS"
if [ ! -f "$DEPS/.complete" ]; then
  exec 9>"$DEPS.lock"
  flock 9
  if [ ! -f "$DEPS/.complete" ]; then
    DEPS_STATE=installed
    rm -rf "$DEPS"
    { grep -v '^#' "$REQS" || true; } | sed '/^\s*$/d' > "$DEPS.req"
    grep '^# no-deps: ' "$REQS" | sed 's/^# no-deps: //' > "$DEPS.nodeps" || true
    if [ "$FLAVOUR" = tpu ]; then sed -i 's/^jax\([=<>~!]\)/jax[tpu]\1/' "$DEPS.req"; fi
    SRC=()
    [ -n "$WH" ] && SRC=(--no-index --find-links "$WH")
    if [ -n "$UV" ]; then
      "$UV" venv -q --python "$PYTHON" "$DEPS"
      # uv hard-links files from its cache; where the cache sits on another mount (a local host's home
      # is a bind mount of its own) links fail and uv would copy every file: symlink instead.
      mkdir -p "$UV_CACHE_DIR"
      touch "$UV_CACHE_DIR/.linktest"
      if [ -z "${UV_LINK_MODE:-}" ] && ! ln -f "$UV_CACHE_DIR/.linktest" "$DEPS/.linktest" 2>/dev/null; then
        export UV_LINK_MODE=symlink
      fi
      rm -f "$DEPS/.linktest"
      [ -s "$DEPS.req" ] && "$UV" pip install -q --python "$DEPS/bin/python" "${SRC[@]}" -r "$DEPS.req"
      [ -s "$DEPS.nodeps" ] && "$UV" pip install -q --python "$DEPS/bin/python" "${SRC[@]}" --no-deps -r "$DEPS.nodeps"
    else
      "$PYTHON" -m venv "$DEPS"
      [ -s "$DEPS.req" ] && "$DEPS/bin/python" -m pip install -q --disable-pip-version-check "${SRC[@]}" -r "$DEPS.req"
      [ -s "$DEPS.nodeps" ] && "$DEPS/bin/python" -m pip install -q "${SRC[@]}" --no-deps -r "$DEPS.nodeps"
    fi
    touch "$DEPS/.complete"
  fi
  exec 9>&-
fi

# ---- layer 2: the project wheel, --no-deps, once per bundle hash
APP="$ROOT/app/$APPHASH"
APP_STATE=cached
step "installing the project wheel into $APP"
if [ ! -f "$APP/.complete" ]; then
  APP_STATE=installed
  TMP="$APP.tmp.$$"
  rm -rf "$TMP"
  if [ -n "$UV" ]; then
    "$UV" pip install -q --python "$DEPS/bin/python" --no-index --no-deps --target "$TMP" "$WHEEL"
  else
    "$DEPS/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps --target "$TMP" "$WHEEL"
  fi
  touch "$TMP/.complete"
  rm -rf "$APP"
  mv "$TMP" "$APP"
fi

PYV=$("$DEPS/bin/python" -c 'import platform; print(platform.python_version())')
echo "TPUCTL_BOOTSTRAP deps=$DEPS_STATE app=$APP_STATE flavour=$FLAVOUR python=$PYV seconds=$(awk "BEGIN{printf \"%.2f\", $(date +%s.%N) - $T0}")"
