"""A stand-in for the hop to a private network (a bastion's `ssh -W %h:%p`, `gcloud compute start-iap-tunnel
--listen-on-stdin`): connects stdin/stdout to HOST:PORT as seen from "inside", and logs every use.

"Inside" is this machine with an address map: `--map 127.1.=127.0.` rewrites a destination that starts with
127.1. to start with 127.0. (a local slice without external IPs reports 127.1.B.I as a worker's internal address;
its sshd listens on 127.0.B.I). Only loopback destinations are allowed. As a ProxyCommand:

    --ssh-proxy-command "python -m infra.ssh_hop --log /tmp/hop.log --map 127.1.=127.0. %h %p"

`--outage FILE` plays the network going away on this machine's side: while FILE exists, the hop cuts the
connections it carries and refuses new ones (a laptop asleep, a Wi-Fi change); the hosts see their clients
vanish, as they would.

With `--as-gcloud` it takes gcloud's IAP form instead (`compute start-iap-tunnel VM PORT --listen-on-stdin
--zone=Z --project=P ...`) and reaches VM through `--vm NAME=ADDRESS` maps: a `gcloud` on PATH for tests.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import selectors
import socket
import sys
import time


def _log(path: str | None, entry: dict) -> None:
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def pump(sock: socket.socket, outage: str | None = None) -> None:
    """stdin -> sock, sock -> stdout, until either side ends (or the outage file appears)."""
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, "in")
    sel.register(sock, selectors.EVENT_READ, "sock")
    while True:
        if outage and os.path.exists(outage):
            return
        for key, _ in sel.select(timeout=0.5 if outage else None):
            if key.data == "in":
                data = os.read(0, 65536)
                if not data:
                    sock.shutdown(socket.SHUT_WR)
                    sel.unregister(0)
                    continue
                sock.sendall(data)
            else:
                data = sock.recv(65536)
                if not data:
                    return
                while data:
                    data = data[os.write(1, data):]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m infra.ssh_hop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", help="append one JSON line per use here")
    ap.add_argument("--map", action="append", default=[], metavar="FROM=TO", help="destination prefix rewrite")
    ap.add_argument("--vm", action="append", default=[], metavar="NAME=ADDRESS", help="(--as-gcloud) VM addresses")
    ap.add_argument("--as-gcloud", action="store_true", help="take gcloud's start-iap-tunnel arguments")
    ap.add_argument("--outage", metavar="FILE", help="while FILE exists: cut every connection, refuse new ones")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    entry = {"argv": a.rest, "pid": os.getpid(), "time": time.time()}
    if a.as_gcloud:
        rest = [x for x in a.rest if not x.startswith("--")]
        if rest[:2] != ["compute", "start-iap-tunnel"] or len(rest) != 4 or "--listen-on-stdin" not in a.rest:
            print(f"gcloud stand-in: expected `compute start-iap-tunnel VM PORT --listen-on-stdin ...`, got {a.rest}",
                  file=sys.stderr)
            return 2
        vms = dict(v.split("=", 1) for v in a.vm)
        if rest[2] not in vms:
            print(f"ERROR: (gcloud.compute.start-iap-tunnel) Could not fetch resource: instance {rest[2]} not found",
                  file=sys.stderr)
            return 1
        host, port = vms[rest[2]], rest[3]
    else:
        if len(a.rest) != 2:
            print("usage: python -m infra.ssh_hop [--log F] [--map FROM=TO] HOST PORT", file=sys.stderr)
            return 2
        host, port = a.rest
    for m in a.map:
        src, _, dst = m.partition("=")
        if host.startswith(src):
            host = dst + host[len(src):]
            break
    entry.update(host=host, port=port)
    try:
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError
    except ValueError:
        print(f"ssh_hop: refusing {host}: only loopback destinations", file=sys.stderr)
        return 2
    if a.outage and os.path.exists(a.outage):
        _log(a.log, {**entry, "error": "outage"})
        print(f"ssh_hop: cannot connect to {host}:{port}: network is unreachable (outage)", file=sys.stderr)
        return 1
    try:
        sock = socket.create_connection((host, int(port)), timeout=10)
    except OSError as e:
        _log(a.log, {**entry, "error": str(e)})
        print(f"ssh_hop: cannot connect to {host}:{port}: {e}", file=sys.stderr)
        return 1
    sock.settimeout(None)
    _log(a.log, entry)
    try:
        pump(sock, a.outage)
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
