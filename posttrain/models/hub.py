"""Model and tokenizer paths that may be Hugging Face Hub ids (`Qwen/Qwen2.5-7B-Instruct`) as well as local folders.

Every loader wants a local directory; an id is turned into one through huggingface_hub's own cache, so a model
downloaded once (here or by `hf download`) is found again, also offline (`HF_HUB_OFFLINE=1`). A failure is a
ConfigError naming the config key, never a hang: offline nothing is requested, and online one short request
(`HF_HUB_ETAG_TIMEOUT` seconds at most) decides first whether the Hub answers. Imports neither torch nor
transformers, so config validation can call `model_source_problem` cheaply.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError

_resolved: dict[tuple[str, str], str] = {}  # (cache folder, id) -> snapshot folder: each id fetched once a process

# Weights in formats other than the safetensors that transformers loads: skipped when a repo has safetensors (Llama's
# original/*.pth alone would double the download), and never required of a cached copy.
OTHER_WEIGHTS = ["original/*", "*.pth", "*.pt", "*.bin", "*.h5", "*.msgpack", "*.ckpt", "*.onnx", "*.gguf", "*.tflite"]


def _offline() -> bool:
    """huggingface_hub reads HF_HUB_OFFLINE once, at import; the environment is read again so that a launcher (or a
    test) that sets it later is obeyed too."""
    from huggingface_hub import constants

    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any((f or "").strip().upper() in ("1", "ON", "YES", "TRUE") for f in flags)


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _local_dir(path: str, key: str) -> str | None:
    """The local directory `path` names, None for a hub id; a ConfigError for anything else."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key} is empty; give a local model directory or a Hugging Face model id (owner/name)")
    local = Path(path).expanduser()
    if local.is_dir():
        lacks = _not_a_model(local)
        if lacks:
            raise ConfigError(f"{key}='{path}' is a folder but not a model: {lacks}; point {key} at a Hugging Face "
                              "model directory")
        return str(local)
    if local.exists():
        raise ConfigError(f"{key}='{path}' is a file; give a model directory or a Hugging Face model id (owner/name)")
    try:
        validate_repo_id(path)
        looks_like_id = path.count("/") == 1
    except HFValidationError:
        looks_like_id = False
    if not looks_like_id:
        raise ConfigError(f"{key}='{path}' is not a local directory (nor a Hugging Face model id of the form "
                          f"owner/name); point {key} at a model directory")
    return None


# What a model or tokenizer folder holds at least one of: its config, weights, or tokenizer files.
MODEL_FILES = ["config.json", "*.safetensors", "*.bin", "adapter_config.json", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt"]


def _not_a_model(folder: Path) -> str | None:
    """What `folder` lacks to be a model (or tokenizer) folder, None when it has any of MODEL_FILES; a run folder or
    checkpoint is named as such, since it takes `posttrain export` to become a model."""
    if any(next(folder.glob(pattern), None) is not None for pattern in MODEL_FILES):
        return None
    if (folder / "actor" / "hf").is_dir() or next(folder.glob("global_step_*"), None) is not None:
        return ("it is a posttrain run folder or checkpoint; `posttrain export RUN_DIR/global_step_N OUT_DIR` writes "
                "a model folder from a checkpoint")
    return "it has no config.json, no weights (*.safetensors, *.bin) and no tokenizer files (tokenizer.json, " \
           "tokenizer_config.json)"


def _cached(repo_id: str) -> str | None:
    """The snapshot folder of `repo_id` in the cache, None when it is not there; reads the disk only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True, ignore_patterns=OTHER_WEIGHTS)
    except LocalEntryNotFoundError:  # also a snapshot the cache knows to be incomplete
        return None


def _missing(repo_id: str, key: str, why: str) -> str:
    return (f"{key}='{repo_id}' is not a local directory, and the Hugging Face model '{repo_id}' is not in the cache "
            f"({_cache()}): {why}. Download it where there is network (`hf download {repo_id}`, with the same "
            f"HF_HOME or HF_HUB_CACHE), or point {key} at a local model directory.")


def _offline_message(repo_id: str, key: str) -> str:
    return _missing(repo_id, key, "HF_HUB_OFFLINE=1 forbids downloading it")


def _fetch(repo_id: str, key: str) -> str:
    """The snapshot folder of `repo_id`: from the cache offline, else downloaded (or brought up to date)."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if _offline():
        folder = _cached(repo_id)
        if folder is None:
            raise ConfigError(_offline_message(repo_id, key))
        return folder
    try:  # snapshot_download's own first request has no time limit: a dead network would hang it for minutes
        files = HfApi().model_info(repo_id, timeout=constants.HF_HUB_ETAG_TIMEOUT).siblings or []
    except Exception as error:  # noqa: BLE001 - any failure to reach the Hub falls back to the cache
        folder = _cached(repo_id)
        if folder is not None:
            return folder
        if isinstance(error, RepositoryNotFoundError):
            why = "the Hub has no such model, or it is private or gated (log in with `hf auth login`)"
        elif isinstance(error, HfHubHTTPError):
            why = f"the Hub refused it ({error})"
        else:
            why = f"the Hub could not be reached ({type(error).__name__}: {str(error) or 'no answer'})"
        raise ConfigError(_missing(repo_id, key, why)) from None
    safetensors = any(f.rfilename.endswith(".safetensors") for f in files)
    try:
        return snapshot_download(repo_id, ignore_patterns=OTHER_WEIGHTS if safetensors else None)
    except Exception as error:  # noqa: BLE001 - a download cut short: what is cached stays, a rerun resumes
        raise ConfigError(_missing(repo_id, key, f"downloading it failed ({type(error).__name__}: {error}); run "
                                   "again to resume")) from None


def _node_first(fetch):
    """In a multi-process job, local rank 0 of each node fetches first and that node's other ranks then read the cache
    it filled (caches are node-local), or every rank repeats the first failure. Imports torch only here, where a
    model is about to load."""
    from ..parallel.context import node_leaders_first

    return node_leaders_first(fetch, ConfigError)


def resolve_model_source(path: str, *, key: str) -> str:
    """A local model directory for `path`: the directory itself, or the cached snapshot of a hub id (downloaded when
    online and missing; once per process). A ConfigError naming `key` when there is none."""
    local = _local_dir(path, key)
    if local is not None:
        return local
    slot = (_cache(), path)
    if slot not in _resolved:
        _resolved[slot] = _node_first(lambda: _fetch(path, key))
    return _resolved[slot]


def model_source_problem(path: str, *, key: str) -> str | None:
    """What `resolve_model_source` would fail with, found without downloading or contacting the Hub: None for a local
    directory, an id in the cache, or an id that can still be downloaded (not offline); else the message."""
    try:
        local = _local_dir(path, key)
    except ConfigError as error:
        return str(error)
    if local is not None or not _offline() or (_cache(), path) in _resolved or _cached(path) is not None:
        return None
    return _offline_message(path, key)
