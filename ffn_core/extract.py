"""ffn-extract: take one layer's FFN out of a checkpoint and write it as native safetensors.

    ffn-extract --format bert --layer 0 model.safetensors layer0.safetensors

The output describes itself (sizes, activation, gating in its metadata), so the service loads it
with `format = "native"` and nothing else. It is written as `save_ffn` writes, mode 0644 less the
umask: readable by the container's user (UID 10001), who is not the file's owner.

Exit status: 0 written; 2 bad arguments, or weights that cannot be read or written (one line on
stderr saying why).
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ffn_core.activations import ACTIVATIONS
from ffn_core.dtypes import DTYPE_NAMES
from ffn_core.families import FAMILIES
from ffn_core.weights import FORMATS, WeightsError, load_ffn, save_ffn


def _version() -> str:
    """The version of the ffn-serve distribution, which ships this command."""
    try:
        return version("ffn-serve")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ffn-extract",
        description="Write one layer's FFN from a checkpoint as a self-describing native safetensors file.",
    )
    parser.add_argument("--version", action="version", version=f"ffn-extract {_version()}")
    parser.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help=f"input format; the checkpoint families {', '.join(FAMILIES)} need --layer",
    )
    parser.add_argument("--layer", type=int, help="which layer's FFN to take (0-based)")
    parser.add_argument(
        "--activation",
        choices=sorted(ACTIVATIONS),
        help="override the family's activation (bert: gelu, gpt2: gelu_tanh, llama: silu; torch: relu)",
    )
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32", help="dtype of the written weights")
    parser.add_argument("input", type=Path, help="checkpoint: .safetensors or a PyTorch state dict (.bin, .pt)")
    parser.add_argument("output", type=Path, help="native safetensors file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; 0 on success, 2 on a weights problem (one line on stderr)."""
    args = _parser().parse_args(argv)
    if _same_file(args.input, args.output):
        print(f"ffn-extract: error: {args.output}: output would overwrite the input checkpoint", file=sys.stderr)
        return 2
    try:
        model = load_ffn(args.input, format=args.format, layer=args.layer, activation=args.activation, dtype=args.dtype)
    except WeightsError as exc:
        print(f"ffn-extract: error: {exc}", file=sys.stderr)
        return 2
    try:
        save_ffn(model, args.output)
    except OSError as exc:
        print(f"ffn-extract: error: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    biases = [name for name in ("bias1", "bias2", "bias_gate") if getattr(config, name)]
    if not config.gated and "bias_gate" in biases:
        biases.remove("bias_gate")
    source = f"layer {args.layer} of {args.input}" if args.layer is not None else str(args.input)
    print(
        f"wrote {args.output}: {config.variant} FFN, d_model {config.d_model}, d_ff {config.d_ff}, "
        f"biases {'+'.join(biases) or 'none'}, {args.dtype}, {params:,} parameters ({source}, {args.format})"
    )
    return 0


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # a symbolic link loop (RuntimeError before Python 3.13): reading reports it
        return False


if __name__ == "__main__":
    raise SystemExit(main())
