"""The real Cloud TPU API: slices are nodes and queued resources in a Google Cloud project."""
from __future__ import annotations

from orchestrator.provider import cloud
from orchestrator.provider.cloud import Api
from orchestrator.provider.base import GCP, Provider
from orchestrator.state import SliceRecord

_APIS: dict[tuple, Api] = {}


class GcpProvider(Provider):
    kind = GCP

    def connect(self, *, project: str | None = None, api_endpoint: str | None = None) -> Api:
        return cloud.connect(api_endpoint=api_endpoint, project=project)

    def api_for(self, rec: SliceRecord, api_endpoint: str | None = None) -> Api:
        key = (api_endpoint or rec.api_endpoint, rec.project)
        if key not in _APIS:  # one client per endpoint and project (each builds an HTTP session)
            _APIS[key] = self.connect(project=rec.project, api_endpoint=key[0])
        return _APIS[key]
