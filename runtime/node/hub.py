"""A model argument as vLLM reads it: a checkpoint directory, or a Hugging Face hub id
(`Qwen/Qwen3-0.6B`) found in the local Hugging Face cache.

Why the cache and never the network: a node must start the same way on a machine with no way
out, and a download half-way through a start is a failure nobody asked for. huggingface_hub
itself reads the cache (its layout, refs and revisions are its own), with `local_files_only`, so
nothing is fetched; a model that is not there is an error naming the cache directory and the
command that fills it.
"""
from __future__ import annotations

import os


class ModelNotFound(ValueError):
    """The model argument is neither a directory nor a hub id in the local cache."""


def cache_dir(download_dir: str | None = None) -> str:
    """The cache directory looked in: `download_dir` (vLLM's --download-dir), else
    huggingface_hub's (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub), read when
    asked so that the environment of this call counts."""
    if download_dir:
        return os.path.abspath(download_dir)
    hub_cache = os.environ.get("HF_HUB_CACHE")
    if hub_cache:
        return hub_cache
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def resolve_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The checkpoint directory of `model`: itself when it is a directory, else the snapshot of
    the hub id `model` (at `revision`, default main) in the local cache. ModelNotFound says
    which, naming the cache."""
    if os.path.isdir(model):
        if revision:
            raise ModelNotFound(f"--revision {revision}: {model} is a directory, not a hub id")
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    where = cache_dir(download_dir)
    try:
        path = snapshot_download(model, revision=revision, cache_dir=where, local_files_only=True)
    except HFValidationError:
        raise ModelNotFound(f"{model}: no such directory, and not a Hugging Face hub id (OWNER/NAME)") from None
    except (LocalEntryNotFoundError, FileNotFoundError):
        rev = f" at revision {revision}" if revision else ""
        raise ModelNotFound(f"{model}: no such directory, and the hub id{rev} is not in the local Hugging Face "
                            f"cache {where} (kvrt never downloads: fetch it first, e.g. `hf download {model}`, "
                            f"or point HF_HOME or --download-dir at the cache that has it)") from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFound(f"{model}: its snapshot {path} in the Hugging Face cache has no config.json (an "
                            f"interrupted download?)")
    return path
