"""A config serving a deliberately slow model: the way to hold work in a real server's queue."""

from __future__ import annotations

from pathlib import Path

import torch

from ffn_core import FFNConfig, build_ffn, save_ffn


def slow_model_config(folder: Path, settings: str = "", *, with_demo: bool = False, d_ff: int = 8192) -> Path:
    """A TOML config serving `slow` (d_model 512, d_ff `d_ff`, ReLU, saved with save_ffn), maybe `demo` too.

    A few thousand rows of `slow` keep the model thread busy for a second or more on a small
    CPU: the way to hold work in the queue behind a forward pass.
    """
    weights = folder / "slow.safetensors"
    if not weights.exists():
        torch.manual_seed(0)
        save_ffn(build_ffn(FFNConfig(d_model=512, d_ff=d_ff, activation="relu")), weights)
    models = '[[models]]\nname = "slow"\nweights = "slow.safetensors"\nformat = "native"\n'
    if with_demo:
        models = '[[models]]\nname = "demo"\n\n' + models  # no weights: the built-in demo
    config = folder / "ffn.toml"
    config.write_text(f"{settings}\n\n{models}")
    return config
