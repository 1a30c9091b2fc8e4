"""`adapt convert-drafter`: turn a published DFlash drafter into one of ours, paired with its target.

    adapt convert-drafter --from dflash SRC --target TARGET --out DIR [--dtype keep]

SRC is a DFlash checkpoint directory as published (z-lab's `DFlashDraftModel` layout: config.json,
*.safetensors, optionally mask_embedding.pt). TARGET is the target model directory it was trained
for; the conversion checks the pairing, takes the mask vector from the target's embedding row of
`mask_token_id` (unless SRC ships mask_embedding.pt) and records the target's fingerprint and
embedding signature, so later loads check the pairing as for drafters we train. `--drafter SRC`
loads the checkpoint unconverted too (docs/drafter.md, "Published DFlash drafters"); converting
saves the target's embedding read at every load and gives the stricter pairing checks.
Prints one JSON object describing the result.
"""

from __future__ import annotations

import json
from pathlib import Path

DTYPES = ("keep", "float32", "bfloat16", "float16")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert-drafter", help="convert a published DFlash drafter into our drafter format",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--from", dest="source_format", required=True, choices=["dflash"],
                   help="the source layout (dflash: z-lab's DFlashDraftModel checkpoints)")
    p.add_argument("source", type=Path, help="the source drafter directory")
    p.add_argument("--target", type=Path, required=True, help="the target model directory the drafter is for")
    p.add_argument("--out", type=Path, required=True, help="directory to write (config.json, model.safetensors)")
    p.add_argument("--dtype", default="keep", choices=DTYPES, help="weight dtype to write (keep = the source's)")
    p.set_defaults(run=run)


def convert(source: Path, target: Path, out: Path, dtype: str = "keep") -> dict:
    """Convert; returns a summary (also what `run` prints)."""
    import torch
    from torch import nn
    from transformers import AutoConfig

    from workers.dflash_format import load_dflash, read_target_embedding
    from workers.drafter import embedding_signature, load_drafter, target_fingerprint

    target_config = AutoConfig.from_pretrained(str(target))
    drafter = load_dflash(source, target_config)
    embedding = read_target_embedding(target)
    if tuple(embedding.shape) != (drafter.config.vocab_size, drafter.config.hidden_size):
        raise ValueError(f"target embedding has shape {tuple(embedding.shape)}, expected "
                         f"({drafter.config.vocab_size}, {drafter.config.hidden_size})")
    if drafter.mask_from_target:
        drafter.fill_mask(nn.Embedding.from_pretrained(embedding))
    drafter.config.embed_signature = embedding_signature(embedding)
    drafter.config.target_fingerprint = target_fingerprint(target_config)
    out_dtype = drafter.source_dtype if dtype == "keep" else getattr(torch, dtype)
    drafter.save_pretrained(out, dtype=out_dtype)
    check = load_drafter(out, target_config)  # the written directory loads and pairs
    cfg = check.config
    return {
        "out": str(out), "from": "dflash", "source": str(source), "target": str(target),
        "block_size": cfg.block_size, "num_layers": cfg.num_layers, "target_layer_ids": cfg.target_layer_ids,
        "mask": (f"target embedding row {drafter.mask_token_id}" if drafter.mask_from_target
                 else "mask_embedding.pt"),
        "dtype": str(out_dtype).removeprefix("torch."),
    }


def run(args) -> int:
    print(json.dumps(convert(args.source, args.target, args.out, args.dtype)))
    return 0
