"""A managed job's record in GCS: what `tpuctl jobs`, `logs` and `cancel` read from any machine, and what a new
controller picks a job up from. Nothing of it lives on the controller's disk.

    gs://BUCKET/tpuctl/jobs/ID/spec.json       what to run (written once, at submit; no secret values)
                              /slice.json      the slice's record as the controller last knew it (workers change
                                               when a preempted slice is recreated)
                              /state.json      written by the controller only: state, step, recoveries, goodput,
                                               every attempt any of the job's controllers saw end, and the one
                                               going on as far as it has been watched (rewritten at each sync)
                              /events.jsonl    written by the controller only: one line per event
                              /cancel.json     written by `tpuctl cancel`: the controller acts on it
                              /logs/controller.log, /logs/RUN_ID/HOST.log   copied as they grow (each
                                               host's own log of each run: HOST is w0, or s1w0 on several slices)
    gs://BUCKET/tpuctl/controller/REGION.json  the controller's heartbeat

One writer per object, so no write ever races another. The google-cloud-storage client finds an emulator
through STORAGE_EMULATOR_HOST, as every other gs:// path in tpuctl does.
"""
from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass

from orchestrator.spec import UserError

PREFIX = "tpuctl"
STATES = ("PENDING", "STARTING", "RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "CANCELLED")
LIVE = ("PENDING", "STARTING", "RUNNING", "RECOVERING")
JOB_ID = re.compile(r"job-\d{8}-\d{6}-[0-9a-f]{4}")


def new_job_id() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)


def is_job_id(s: str) -> bool:
    return bool(JOB_ID.fullmatch(s))


def bucket_of(path: str, what: str = "--ckpt-dir") -> str:
    m = re.fullmatch(r"gs://([a-z0-9][a-z0-9._-]{1,220}[a-z0-9])(/.*)?", path.strip())
    if not m:
        raise UserError(f"{what} {path}: expected gs://BUCKET[/PREFIX]")
    return m.group(1)


@dataclass
class JobStore:
    bucket_name: str

    def __post_init__(self):
        from google.cloud import storage
        self.client = storage.Client()
        self.bucket = self.client.bucket(self.bucket_name)

    # ---- plumbing
    def _blob(self, rel: str):
        return self.bucket.blob(f"{PREFIX}/{rel}")

    def _get_json(self, rel: str) -> dict | None:
        from google.api_core import exceptions as gx
        try:
            return json.loads(self._blob(rel).download_as_bytes())
        except gx.NotFound:
            return None

    def _put_json(self, rel: str, obj: dict) -> None:
        self._blob(rel).upload_from_string(json.dumps(obj, indent=1, sort_keys=True),
                                           content_type="application/json")

    # What a submit does as its caller: write the job's record and bundle, read them back (the controller's
    # account, which replaces and removes objects, is checked apart: bucket_access).
    SUBMIT_PERMISSIONS = ("storage.objects.create", "storage.objects.get")

    def check(self, *, iam_endpoint: str | None = None, project: str | None = None, credentials=None) -> None:
        """The bucket exists and this caller can write it: one line naming the fix otherwise. Asked, never tried:
        the bucket's testIamPermissions (on iam_endpoint, Cloud Storage's own when None, as `credentials`, the
        caller's when None) answers for the caller, so a caller who may create but not delete objects leaves
        nothing behind."""
        from google.api_core import exceptions as gx

        def missing() -> UserError:
            return UserError(f"bucket gs://{self.bucket_name} does not exist: create it (gcloud storage buckets "
                             f"create gs://{self.bucket_name}) or point --ckpt-dir at another")
        try:
            if not self.bucket.exists():
                raise missing()
        except gx.Forbidden:  # may not read the bucket's metadata (storage.buckets.get): the permissions tell
            pass
        from google.cloud import storage
        kw = {"client_options": {"api_endpoint": iam_endpoint}} if iam_endpoint else {}
        on_iam = storage.Client(project=project, credentials=credentials, **kw).bucket(self.bucket_name)
        try:
            held = set(on_iam.test_iam_permissions(list(self.SUBMIT_PERMISSIONS), timeout=30))
        except gx.NotFound:
            raise missing() from None
        except gx.GoogleAPICallError as e:
            raise UserError(f"cannot tell whether you may write gs://{self.bucket_name} (testIamPermissions: "
                            f"{(str(e).strip().splitlines() or [type(e).__name__])[0][:200]})") from None
        lacks = [p for p in self.SUBMIT_PERMISSIONS if p not in held]
        if lacks:
            raise UserError(f"cannot write gs://{self.bucket_name} (you lack {', '.join(lacks)}): grant "
                            "roles/storage.objectAdmin on it to your account and to the controller's service "
                            "account")

    # ---- one job
    def put_spec(self, job_id: str, spec: dict) -> None:
        self._put_json(f"jobs/{job_id}/spec.json", spec)

    def spec(self, job_id: str) -> dict | None:
        return self._get_json(f"jobs/{job_id}/spec.json")

    def put_slice(self, job_id: str, rec: dict) -> None:
        self._put_json(f"jobs/{job_id}/slice.json", rec)

    def slice(self, job_id: str) -> dict | None:
        return self._get_json(f"jobs/{job_id}/slice.json")

    def put_state(self, job_id: str, st: dict) -> None:
        self._put_json(f"jobs/{job_id}/state.json", {**st, "updated": time.time()})

    def state(self, job_id: str) -> dict | None:
        return self._get_json(f"jobs/{job_id}/state.json")

    def put_events(self, job_id: str, events: list[dict]) -> None:
        self._blob(f"jobs/{job_id}/events.jsonl").upload_from_string(
            "".join(json.dumps(e, sort_keys=True) + "\n" for e in events), content_type="text/plain")

    def events(self, job_id: str) -> list[dict]:
        from google.api_core import exceptions as gx
        try:
            text = self._blob(f"jobs/{job_id}/events.jsonl").download_as_text()
        except gx.NotFound:
            return []
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def request_cancel(self, job_id: str, down: bool) -> None:
        self._put_json(f"jobs/{job_id}/cancel.json", {"at": time.time(), "down": down})

    def cancel_request(self, job_id: str) -> dict | None:
        return self._get_json(f"jobs/{job_id}/cancel.json")

    def put_log(self, job_id: str, rel: str, data: bytes) -> None:
        self._blob(f"jobs/{job_id}/logs/{rel}").upload_from_string(data, content_type="text/plain")

    def logs(self, job_id: str) -> dict[str, bytes]:
        """Every log of the job: {"controller.log": ..., "RUN_ID/w0.log": ...}."""
        pre = f"{PREFIX}/jobs/{job_id}/logs/"
        return {b.name[len(pre):]: b.download_as_bytes() for b in self.client.list_blobs(self.bucket, prefix=pre)}

    def host_log_sizes(self, job_id: str, host: str) -> dict[str, int]:
        """{run_id: bytes so far} of one host's own log (HOST: w0, s1w0) in each of the job's runs."""
        pre = f"{PREFIX}/jobs/{job_id}/logs/"
        out = {}
        for b in self.client.list_blobs(self.bucket, prefix=pre):
            run, _, name = b.name[len(pre):].rpartition("/")
            if run and "/" not in run and name == f"{host}.log":
                out[run] = b.size
        return out

    def log_bytes(self, job_id: str, rel: str, start: int = 0) -> bytes:
        """One log of the job from byte `start` on (what a follower has not read yet)."""
        return self._blob(f"jobs/{job_id}/logs/{rel}").download_as_bytes(start=start)

    # ---- every job
    def job_ids(self) -> list[str]:
        pre = f"{PREFIX}/jobs/"
        it = self.client.list_blobs(self.bucket, prefix=pre, delimiter="/")
        list(it)  # the prefixes arrive with the pages
        return sorted(p[len(pre):].rstrip("/") for p in it.prefixes if is_job_id(p[len(pre):].rstrip("/")))

    def jobs(self) -> list[dict]:
        """Every job's state (spec fields filled in for a job no controller has taken yet), oldest first."""
        out = []
        for jid in self.job_ids():
            st = self.state(jid)
            if st is None:
                spec = self.spec(jid)
                if spec is None:
                    continue
                st = initial_state(spec)
            out.append(st)
        return out

    # ---- the controller
    def put_heartbeat(self, region: str, hb: dict) -> None:
        self._put_json(f"controller/{region}.json", {**hb, "at": time.time()})

    def restore_heartbeat(self, region: str, hb: dict | None) -> None:
        """Put back a heartbeat as it was read (None: there was none), as when a controller VM was refused."""
        from google.api_core import exceptions as gx
        if hb is not None:
            self._put_json(f"controller/{region}.json", hb)
            return
        try:
            self._blob(f"controller/{region}.json").delete()
        except gx.NotFound:
            pass

    def heartbeat(self, region: str) -> dict | None:
        return self._get_json(f"controller/{region}.json")


def initial_state(spec: dict) -> dict:
    return {"id": spec["id"], "name": spec["name"], "slice": spec["slice_name"], "state": "PENDING",
            "submitted": spec["submitted"], "step": None, "total_steps": spec.get("total_steps"), "recoveries": 0,
            "goodput": None, "run_id": None, "controller": None, "ended": None, "message": "",
            "price_per_hour": spec.get("price_per_hour", 0.0)}


def cost_so_far(st: dict, now: float | None = None) -> float:
    """The slice's list price over the job's life so far (submit to end); the controller's own share is in
    `tpuctl controller status`."""
    end = st.get("ended") or (now or time.time())
    return max(0.0, end - st["submitted"]) / 3600 * float(st.get("price_per_hour") or 0.0)
