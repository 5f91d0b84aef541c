"""The Hugging Face hub reader, which fails fast, naming the local alternative, when the hub cannot be reached."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from pipeline.data.sources.base import DataError
from pipeline.data.sources.columnar import DatasetSource

# What to tell a user whose hub download cannot work; the shared data README names these folders.
LOCAL_ALTERNATIVE = (
    "use local files instead: a source with 'format: text' and 'path: <prefix>' reads <prefix>.<lang> "
    "(e.g. configs/data/multi30k.yaml reads multi30k/train.en + .de under data.root; see docs/tutorials/own-data.md)"
)


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_reachable(timeout: float = 5.0) -> str | None:
    """None when the hub endpoint answers a TCP connect, else why not (DNS, refused, timeout)."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return None
    except OSError as e:
        return f"{url.hostname}:{port}: {e}"


class HubUnavailable(DataError):
    """The hub could not be reached or did not serve the dataset: worth retrying later (unlike bad input)."""


class HubSource(DatasetSource):
    """A dataset on the Hugging Face hub, cached under ``HF_DATASETS_CACHE``.

    Fails in seconds, naming the local alternative, when the hub cannot be reached: a TCP probe first (the
    ``datasets`` client otherwise retries for minutes), and ``HF_HUB_OFFLINE=1`` is honoured (cache only).
    """

    def _load(self):
        import datasets

        spec = self.spec
        self.info.location = {"dataset": spec.dataset, "subset": spec.subset or "", "split": spec.split,
                              "revision": spec.revision or ""}
        ident = f"{spec.dataset}" + (f" ({spec.subset})" if spec.subset else "") + f" split {spec.split!r}"
        if (local := Path(spec.dataset)).exists():  # load_dataset would read it instead of the hub
            raise DataError(
                f"{self.where}.dataset = {spec.dataset!r} is also a path from the working directory "
                f"({local.resolve()}): the datasets library would read it, outside data.root, instead of the hub. "
                "For a local copy use format hf_disk, parquet or arrow with a path under data.root; for the hub "
                "dataset, run from a working directory without that path")
        if not _hub_offline() and (why := _hub_reachable()):
            raise HubUnavailable(
                f"{self.where}: cannot reach the Hugging Face hub for {ident} ({why}). If the dataset is in your "
                f"cache, set HF_HUB_OFFLINE=1 to use it; otherwise {LOCAL_ALTERNATIVE}"
            )
        try:
            return datasets.load_dataset(spec.dataset, spec.subset, split=spec.split, revision=spec.revision)
        except Exception as e:  # the hub client raises many types (HTTP, offline, missing split); all end here
            if _hub_offline():
                raise DataError(f"{self.where}: could not load {ident}: {type(e).__name__}: {e}. HF_HUB_OFFLINE is "
                                f"set and it is not in the cache; {LOCAL_ALTERNATIVE}") from None
            raise HubUnavailable(f"{self.where}: could not load {ident}: {type(e).__name__}: {e}. "
                                 f"{LOCAL_ALTERNATIVE}") from None
