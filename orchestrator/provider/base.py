"""The interface every place where slices live implements (`Provider`), with the real cloud's behaviour as its
defaults; orchestrator/provider/__init__.py picks the implementation."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from orchestrator.provider import cloud
from orchestrator.provider.cloud import Api
from orchestrator.spec import SliceSpec, UserError
from orchestrator.state import SliceRecord, Worker

Progress = Callable[[str], None]
GCP, LOCAL = "gcp", "local"


@dataclass(frozen=True)
class HostAccess:
    """How this machine reaches a slice's hosts, where the provider knows better than the TPU VM defaults."""
    user: str | None = None
    key: str | None = None
    port: int | None = None
    python: str | None = None      # an interpreter the hosts share with this machine (installs from a wheelhouse)
    wheelhouse: str | None = None  # a wheelhouse the hosts see at the same path


class Provider:
    """One place slices live. The defaults are the real cloud's behaviour: nothing beyond the TPU API."""
    kind: str = ""
    cli_flags: tuple[str, ...] = ()  # what a tpuctl command line adds to pick this provider
    cpu_devices: bool = False      # the hosts' devices are emulated CPU devices (plans use the CPU compiler)

    default_project: str | None = None  # the project when none is given (None: the environment's, gcloud's)

    # ---- the TPU API
    def endpoint(self, api_endpoint: str | None = None) -> str | None:
        """The URL the client will talk to (None: the default googleapis.com endpoint)."""
        return cloud.resolve_endpoint(api_endpoint)

    def connect(self, *, project: str | None = None, api_endpoint: str | None = None) -> Api:
        raise NotImplementedError

    def api_for(self, rec: SliceRecord, api_endpoint: str | None = None) -> Api:
        """The API that holds a recorded slice (api_endpoint: read it through another endpoint)."""
        return self.connect(project=rec.project, api_endpoint=api_endpoint or rec.api_endpoint)

    def endpoint_of(self, api: Api) -> str | None:
        """What a record keeps to find its API again (None: resolved afresh each time)."""
        return api.endpoint

    def owns(self, rec: SliceRecord, api: Api) -> bool:
        """Whether `gc` through `api` is responsible for this record."""
        return rec.provider == self.kind and rec.project == api.project and rec.api_endpoint == api.endpoint

    # ---- creating
    def check(self, spec: SliceSpec) -> None:
        """Refuse what this place cannot do, before anything is created."""
        if spec.provider_options:
            raise UserError(f"{', '.join(sorted(spec.provider_options))}: only for local slices; add --local")

    def default_zones(self, spec: SliceSpec) -> list[str]:
        hints = ", ".join(spec.accelerator_type.zone_hints)
        raise UserError(f"no zone given: pass --zone Z (or --zones a,b,c); zones offering {spec.accelerator} "
                        f"per the catalog: {hints}")

    def attach(self, api: Api, rec: SliceRecord, progress: Progress) -> list[Worker]:
        """After READY: the workers as SSH reaches them."""
        return rec.workers

    # ---- the VMs' end
    def release(self, name: str, progress: Progress) -> None:
        """The slice's VMs are gone (deleted or preempted): end what goes with them."""

    def orphans(self, recorded: set[str]) -> list[str]:
        """`gc`: names of slices no record names any more for which this place still runs something (`release`
        ends it)."""
        return []

    # ---- running on the hosts
    def host_access(self, name: str) -> HostAccess:
        return HostAccess()

    def run_env(self, name: str, command: list[str], devices_per_host: int | None) -> dict[str, str]:
        """Environment variables a run needs on every host (the contract is in docs/CONTRACTS.md)."""
        return {}

    def local_env(self, paths: list[str]) -> dict[str, str]:
        """Environment for trainer commands this machine runs itself against the run's storage (sweep plans,
        reports)."""
        return {}

    # ---- managed jobs: the controller's VM, the job bucket, the jobs' secrets (orchestrator/jobs/managed.py)
    def compute_endpoint(self) -> str | None:
        """The Compute Engine API (None: the default endpoint; TPUCTL_COMPUTE_API_ENDPOINT overrides)."""
        return os.environ.get("TPUCTL_COMPUTE_API_ENDPOINT") or None

    def secrets_endpoint(self) -> str | None:
        """The Secret Manager API (None: the default endpoint)."""
        return os.environ.get("TPUCTL_SECRETS_API_ENDPOINT") or None

    def secrets_credentials(self, member: str | None = None):
        """Credentials for Secret Manager: this machine's own (None: the environment's). A controller VM calls as
        its service account through its metadata server, which the default credentials already are."""
        return None

    def storage_env(self, bucket: str) -> dict[str, str]:
        """Environment this machine's storage client needs to reach gs://bucket (nothing: the real GCS)."""
        return {}

    def storage_up(self) -> bool:
        """Whether the storage serving gs:// is there without starting anything (a read that must not create)."""
        return True

    def bucket_iam_endpoint(self, bucket: str, project: str) -> str | None:
        """Where gs://bucket's IAM is asked (its policy, testIamPermissions): None, the Cloud Storage API itself.
        project: the one the caller works in (a stand-in may need to be told the bucket is that project's)."""
        return None

    def as_account(self, email: str):
        """Credentials that act as service account `email` (google.auth's impersonated credentials: the caller
        needs roles/iam.serviceAccountTokenCreator on it, else the first request is refused): what submit asks
        testIamPermissions with, since that call answers for its caller only."""
        import google.auth
        from google.auth import impersonated_credentials
        scope = ["https://www.googleapis.com/auth/cloud-platform"]
        src, _ = google.auth.default(scopes=scope)
        return impersonated_credentials.Credentials(source_credentials=src, target_principal=email,
                                                    target_scopes=scope, lifetime=300)

    def resource_manager_endpoint(self) -> str | None:
        """The Cloud Resource Manager API: projects and their IAM policies (None: the default endpoint;
        TPUCTL_RESOURCE_MANAGER_API_ENDPOINT overrides)."""
        return os.environ.get("TPUCTL_RESOURCE_MANAGER_API_ENDPOINT") or None

    def controller_runtime(self) -> tuple[str | None, dict[str, str]]:
        """(python, env) for the controller's startup script: None installs tpuctl on the VM from the bundle."""
        return None, {}

    def controller_started(self, project: str, zone: str, instance: str, progress: Progress) -> None:
        """The controller's VM is RUNNING: it boots its startup script by itself."""

    def stop_services(self) -> None:
        """End what this place runs on this machine for its slices (nothing, for a real cloud)."""
