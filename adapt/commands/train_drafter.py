"""`adapt train-drafter`: train a block-diffusion drafter for any supported target.

    adapt train-drafter --target DIR --data PATH... --out DIR [--regenerate] [--resume]
    adapt train-drafter --target DIR --features HARVEST_DIR --draft-vocab 8192 --out DIR [--resume]

The options and the training recipe are those of `workers.training.drafter` (see its docstring
and docs/training.md); this module only wires them into the CLI.
"""

from __future__ import annotations


def add_parser(subparsers) -> None:
    from workers.training.drafter_options import add_arguments

    parser = subparsers.add_parser(
        "train-drafter",
        help="train a block-diffusion drafter for a frozen target (Llama, Qwen2, Qwen3)",
        description="Train a block-diffusion drafter for a frozen target; writes config.json, "
                    "model.safetensors and eval.json to --out.",
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


def run(args) -> int:
    if args.features is not None:  # harvested features: workers/training/feature_drafter.py
        from workers.training.feature_drafter import train as train_on_features

        args.data = args.features
        train_on_features(args)
        return 0
    from workers.training.drafter import train

    train(args)
    return 0
