"""`tpuctl data pull OWNER/DATASET[/versions/N] --to gs://BUCKET/PREFIX`: a Kaggle dataset staged once in GCS.

The same contract as `tpuctl weights pull`, through the same code (orchestrator/artifacts/weights.py `stage`): kagglehub
downloads on the user's machine (its cache, its resume of a cut file, its md5 check), each file is uploaded
under the prefix, and the manifest is written last; a pull cut short resumes; credentials are kagglehub's
and never pass through tpuctl. Hosts then read the prefix with `--data gs://BUCKET/PREFIX`: a nanoGPT folder
(train.bin/val.bin) or llm.c shards train as they are (trainer/pretrain/data.py).

Without --file, kagglehub fetches the version as one zip and unpacks it in its cache (twice the dataset's size
on the local disk for a moment); --file NAME fetches only the named files, one by one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

from orchestrator.artifacts import weights as W
from orchestrator.spec import UserError

_SLUG = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
_HANDLE_RE = re.compile(rf"({_SLUG})/({_SLUG})(?:/versions/(\d+))?")


@dataclass(frozen=True)
class DatasetHandle:
    owner: str
    dataset: str
    version: int | None = None

    kind = "dataset"
    use_as = "train on it with --data"
    fields = "owner/dataset/versions/N"

    def __str__(self) -> str:
        base = f"{self.owner}/{self.dataset}"
        return base if self.version is None else f"{base}/versions/{self.version}"

    @property
    def page(self) -> str:
        return f"kaggle.com/datasets/{self.owner}/{self.dataset}"

    @property
    def licence_name(self) -> str:
        return f"{self.owner}/{self.dataset}"

    def with_version(self, version: int) -> "DatasetHandle":
        return DatasetHandle(self.owner, self.dataset, int(version))

    def kagglehub_handle(self):
        from kagglehub import handle as kh
        return kh.parse_dataset_handle(str(self))

    def kagglehub_download(self, path: str | None = None) -> str:
        import kagglehub
        return kagglehub.dataset_download(str(self), path)


def parse_handle(handle: str) -> DatasetHandle:
    m = _HANDLE_RE.fullmatch(handle.strip().strip("/"))
    if not m:
        raise UserError(f"dataset {handle!r}: expected OWNER/DATASET[/versions/N], e.g. "
                        "windmaple/OpenWebText-gpt2 or windmaple/OpenWebText-gpt2/versions/1")
    owner, name, ver = m.groups()
    return DatasetHandle(owner, name, int(ver) if ver else None)


def pull(handle: str, dest: str, *, files: Sequence[str] = (), endpoint: str | None = None,
         say: Callable[[str], None] = print, progress: bool = True) -> W.PullResult:
    """Download dataset `handle` (all of it, or only `files`) through kagglehub and stage it under `dest`."""
    h = parse_handle(handle)
    for f in files:
        if f.startswith("/") or ".." in f.split("/") or not f.strip("/"):
            raise UserError(f"--file {f!r}: expected a path inside the dataset, e.g. train.bin")
    return W.stage(h, dest, endpoint=endpoint, say=say, progress=progress, given=handle, files=list(files) or None)
