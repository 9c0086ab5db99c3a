"""Names the stand-ins of Google's APIs share, so a project reads the same in every one of them."""
from __future__ import annotations


def project_number(project: str) -> int:
    """A stable made-up project number for a project id (the real APIs know the real one)."""
    return 100000000000 + sum((i + 1) * ord(c) for i, c in enumerate(project)) * 7919 % 900000000000


def default_service_account(project: str) -> str:
    """What a VM's `serviceAccounts[].email: "default"` becomes: the project's Compute Engine default account."""
    return f"{project_number(project)}-compute@developer.gserviceaccount.com"
