"""Where slices live, behind one interface: the real Cloud TPU API (`gcp`) or this machine (`local`).

Everything above this package (slices, run, supervise, the CLI) talks to a `Provider` and never asks which one
it is. Both speak the real Cloud TPU API through the real client (`orchestrator.provider.cloud.Api`): the local provider
only points it at the stand-in, and owns what the stand-in cannot be: hosts (sshd on loopback), the GCS
emulator, emulated devices, and the VMs dying with a preemption.

A slice's record names its provider (`SliceRecord.provider`); a command on a recorded slice uses that one, a
command that creates or looks up an unrecorded slice uses the one the user picked (`--local`).
"""
from __future__ import annotations

from orchestrator.provider.base import GCP, LOCAL, HostAccess, Progress, Provider
from orchestrator.spec import UserError
from orchestrator.state import SliceRecord

__all__ = ["GCP", "LOCAL", "HostAccess", "Progress", "Provider", "get", "chosen", "of"]


def get(kind: str) -> Provider:
    if kind == GCP:
        from orchestrator.provider.gcp import GcpProvider
        return GcpProvider()
    if kind == LOCAL:
        from orchestrator.provider.local import LocalProvider
        return LocalProvider()
    raise UserError(f"unknown provider {kind!r}: {GCP} or {LOCAL}")


def chosen(local: bool | None) -> Provider:
    """The provider a user picked with --local (or not)."""
    return get(LOCAL if local else GCP)


def of(rec: SliceRecord) -> Provider:
    return get(rec.provider)
