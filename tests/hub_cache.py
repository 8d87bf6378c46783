"""A Hugging Face Hub cache laid out as huggingface_hub lays it out, for tests that cannot reach the Hub.

    <cache>/models--<org>--<name>/
        blobs/<sha256 of the file>        an LFS file (weights): its blob is named by its SHA-256
        blobs/<git blob sha1>             a plain file (config.json): by git's object id
        refs/main                         the commit the branch points to
        snapshots/<commit>/<filename>     a relative symlink to ../../blobs/<id>

`add_repo` writes that; the tests check that huggingface_hub's own readers (scan_cache_dir,
try_to_load_from_cache, hf_hub_download with local_files_only) find every file in it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin")  # stored through LFS on the Hub: blob named by its SHA-256


def repo_folder(cache: Path, repo_id: str) -> Path:
    return cache / ("models--" + repo_id.replace("/", "--"))


def commit_of(repo_id: str, files: Mapping[str, Path]) -> str:
    """A 40-hex commit id, as git's: fixed by the repository's name and its files' names."""
    return hashlib.sha1((repo_id + "".join(sorted(files))).encode()).hexdigest()


def blob_id(filename: str, path: Path) -> str:
    """The blob's name in the cache: the ETag the Hub sends (SHA-256 for LFS files, git's sha1 otherwise)."""
    data = path.read_bytes()
    if filename.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_repo(cache: Path, repo_id: str, files: Mapping[str, Path], branch: str = "main") -> str:
    """Put `files` (name in the repository -> a local file) in `cache` as the snapshot `branch` points to; its commit."""
    folder = repo_folder(cache, repo_id)
    commit = commit_of(repo_id, files)
    for filename, source in files.items():
        blob = folder / "blobs" / blob_id(filename, source)
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(source, blob)
        link = folder / "snapshots" / commit / filename
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    refs = folder / "refs" / branch
    refs.parent.mkdir(parents=True, exist_ok=True)
    refs.write_text(commit)
    return commit
