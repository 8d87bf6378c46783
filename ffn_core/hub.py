"""A checkpoint straight from the Hugging Face Hub, through huggingface_hub's own cache.

`hub_weights(repo_id, revision, layer, format)` is the local file that holds the checkpoint's
weights: `model.safetensors` in the repository's snapshot in the cache, or, for a sharded
checkpoint, only the shard that holds the asked layer's FFN (from `model.safetensors.index.json`).
huggingface_hub fetches what the cache lacks, unless `HF_HUB_OFFLINE` is set; it reads `HF_HOME`
and `HF_HUB_CACHE` for the cache's place and `HF_TOKEN` for private and gated repositories. The
layer is then read as from any local file (ffn_core/checkpoints.py): only its tensors.

`hub_format(weights)` is the checkpoint family that the snapshot's `config.json` names
(`model_type`), where no format was given. `cached_weights` finds the file a load would read,
without fetching, for the command's checks before torch is imported. No torch here. huggingface_hub is an optional dependency
(`pip install 'ffn-serve[hub]'`); without it every call says so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ffn_core.errors import WeightsError, brief
from ffn_core.families import FAMILIES

HUB_EXTRA = "pip install 'ffn-serve[hub]'"
WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# config.json's model_type -> the checkpoint family whose layout that architecture's weights have.
MODEL_TYPES = {"bert": "bert", "gpt2": "gpt2", "llama": "llama"}
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_weights(repo_id: str, revision: str | None, layer: int | None, format: str | None) -> Path:
    """The file in huggingface_hub's cache holding `repo_id`'s weights at `revision` (main if None),
    fetched unless HF_HUB_OFFLINE; for a sharded checkpoint, the one shard holding layer `layer`'s FFN."""
    where = f"{repo_id}@{revision or 'main'}"
    if format == "torch":
        raise WeightsError(
            f"{where}: the Hub's weights are read from {WEIGHTS_FILE}; format 'torch' is for local files"
        )
    try:
        if format is None:
            format = hub_format(_fetch(repo_id, CONFIG_FILE, revision))
        try:
            return _fetch(repo_id, WEIGHTS_FILE, revision)
        except _Missing as whole:
            try:
                index = _fetch(repo_id, SHARD_INDEX, revision)
            except _Missing:
                if whole.unasked:  # nothing known of the repository's files: say why, not what it lacks
                    raise WeightsError(f"{where}: {whole.reason}") from None
                raise WeightsError(
                    f"{where}: no {WEIGHTS_FILE} and no {SHARD_INDEX} ({whole.reason}); "
                    "only safetensors checkpoints are read"
                ) from None
        return _fetch(repo_id, _shard_of(index, format, layer, where), revision)
    except _Missing as missing:
        raise WeightsError(f"{where}: {missing.reason}") from None


def cached_weights(repo_id: str, revision: str | None) -> Path | None:
    """`repo_id`'s model.safetensors as the cache holds it, where a load would read that very file: with
    HF_HUB_OFFLINE set, or at a commit (which never moves). None otherwise; nothing is fetched."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:
        return None
    if not (constants.HF_HUB_OFFLINE or (revision is not None and _COMMIT.fullmatch(revision))):
        return None  # a load asks the Hub first: main may have moved past the cached snapshot
    found = try_to_load_from_cache(repo_id, WEIGHTS_FILE, revision=revision)
    return Path(found) if isinstance(found, str) else None


def hub_format(weights: Path) -> str:
    """The checkpoint family named by the config.json beside `weights` in its snapshot (`model_type`)."""
    config = weights.parent / CONFIG_FILE
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise WeightsError(
            f"{config}: cannot read the model_type that names the checkpoint family ({brief(exc)})"
        ) from None
    if model_type not in MODEL_TYPES:
        raise WeightsError(
            f"{config}: model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}; "
            f"name the format ({', '.join(FAMILIES)}) if its weights have one of those layouts"
        )
    return MODEL_TYPES[model_type]


class _Missing(Exception):
    """The repository has no such file, or the cache lacks it and the Hub cannot be asked (`unasked`)."""

    def __init__(self, reason: str, *, unasked: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unasked = unasked


def _fetch(repo_id: str, filename: str, revision: str | None) -> Path:
    """`filename` of the repository, from the cache (fetched first unless HF_HUB_OFFLINE)."""
    try:
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub import errors as hub
    except ImportError:
        raise WeightsError(f"hf_model needs huggingface_hub: {HUB_EXTRA}") from None
    where = f"{repo_id}@{revision or 'main'}"
    try:
        return Path(hf_hub_download(repo_id, filename, revision=revision))
    except hub.LocalEntryNotFoundError:  # before EntryNotFoundError, which it derives from
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub could not be reached"
        raise _Missing(f"{filename} is not in the cache ({constants.HF_HUB_CACHE}) and {why}", unasked=True) from None
    except hub.GatedRepoError:  # before RepositoryNotFoundError, which it derives from
        raise WeightsError(f"{where}: a gated repository: accept its terms on the Hub, then set HF_TOKEN") from None
    except hub.RepositoryNotFoundError:
        raise WeightsError(f"{where}: no such repository on the Hub (a private one needs HF_TOKEN)") from None
    except hub.RevisionNotFoundError:
        raise WeightsError(f"{where}: the repository has no revision {revision!r}") from None
    except hub.EntryNotFoundError:
        raise _Missing(f"the repository has no {filename}") from None
    except (hub.HfHubHTTPError, OSError, ValueError) as exc:
        raise WeightsError(f"{where}: cannot fetch {filename} ({brief(exc)})") from None


def _shard_of(index: Path, format: str, layer: int | None, where: str) -> str:
    """The one shard that holds layer `layer`'s FFN tensors, from a sharded checkpoint's index."""
    family = FAMILIES.get(format)
    if family is None or layer is None:
        raise WeightsError(f"{where}: a sharded checkpoint is read one layer at a time: give a family and a layer")
    try:
        weight_map: dict[str, Any] = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightsError(f"{index}: not a safetensors index ({brief(exc)})") from None
    keys = {
        f"{prefix}{family.layers.format(i=layer)}{module}.{kind}"
        for prefix in family.prefixes
        for module in family.linears.values()
        for kind in ("weight", "bias")
    }
    shards = sorted({str(weight_map[key]) for key in keys if key in weight_map})
    if not shards:
        raise WeightsError(f"{where}: {SHARD_INDEX} names no {format} layer {layer} FFN tensor")
    if len(shards) > 1:
        raise WeightsError(f"{where}: layer {layer}'s FFN is split over shards {shards}; one shard is read at a time")
    return shards[0]
