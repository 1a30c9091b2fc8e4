"""Tiny randomly initialised target + drafter directories for tests (real weights, real files).

    from tests.tiny_models import make_tiny_pair
    target_dir, drafter_dir = make_tiny_pair(tmp_path)                      # Llama, vocab 512
    target_dir, drafter_dir = make_tiny_pair(tmp_path, family="qwen3", vocab=8)

The target is a standard Hugging Face directory saved with `save_pretrained` (config.json,
model.safetensors and, when vocab >= 300, a byte-level BPE tokenizer trained on a few lines of
text), so plain `transformers` loads it. The drafter is `workers.drafter.init_drafter` for that
target, saved with its own `save_pretrained`. Everything is seeded: same arguments, same bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")

_TEXT = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
    "The quick brown fox jumps over the lazy dog. Hello world!\n",
] * 4


def tiny_hf_config(family: str = "llama", vocab: int = 512, hidden: int = 64, layers: int = 2,
                   heads: int = 4, kv_heads: int = 2, intermediate: int = 128, tie: bool | None = None,
                   init_std: float = 0.2):
    """A transformers config of a tiny model of `family` (GQA by default; Qwen2/Qwen3 untied)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=init_std,
                  tie_word_embeddings=(family == "llama") if tie is None else tie,
                  bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if family == "qwen3":
        kwargs["head_dim"] = hidden // heads
    return cls(**kwargs)


def _save_tokenizer(vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    fast.model_max_length = 2048
    fast.save_pretrained(out)


def make_tiny_target(out_dir, family: str = "llama", vocab: int = 512, seed: int = 0, **config_kwargs) -> Path:
    """Save a tiny random `family` causal LM (fp32) to `out_dir`; returns the directory."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, vocab, **config_kwargs))
    model.save_pretrained(out, safe_serialization=True)
    if vocab >= 300:
        _save_tokenizer(vocab, out)
    return out


def train_tiny_drafter(drafter, target, steps: int, seed: int = 0, seq_len: int = 48, batch: int = 16) -> None:
    """A few Adam steps of the real drafter loss (workers.training.drafter) on the target's own greedy
    continuations of random prompts, so that drafts get accepted (greedy and sampled)."""
    from workers.training.drafter import drafter_loss, position_weights, sample_anchors, sample_known

    gen = torch.Generator().manual_seed(seed)
    vocab, K = target.config.vocab_size, drafter.config.block_size
    prompts = torch.randint(2, vocab, (64, 4), generator=gen)
    with torch.no_grad():
        seqs = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=seq_len - 4,
                               min_new_tokens=seq_len - 4, do_sample=False, pad_token_id=1)
    weights = position_weights(K, 7.0)
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        rows = torch.randint(0, seqs.shape[0], (batch,), generator=gen)
        anchors = sample_anchors(batch, seq_len, 6, 3, K, gen)
        known = sample_known(batch, anchors.shape[1], K, gen)
        loss, _ = drafter_loss(drafter, target, seqs[rows], anchors, known, weights, 0.5, False)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    drafter.eval()


def make_tiny_drafter(out_dir, target_dir, seed: int = 0, block_size: int = 16, num_layers: int = 1,
                      train_steps: int = 0) -> Path:
    """Save a drafter paired with the target in `target_dir`: randomly initialised, then trained for
    `train_steps` steps on the target's greedy continuations (0 = untrained)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.drafter import init_drafter

    hf_cfg = AutoConfig.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval().requires_grad_(False)
    drafter = init_drafter(hf_cfg, target.get_input_embeddings(), target.get_output_embeddings(), seed=seed,
                           num_layers=num_layers, block_size=block_size)
    if train_steps:
        train_tiny_drafter(drafter, target, train_steps, seed)
    drafter.save_pretrained(out_dir)
    return Path(out_dir)


def make_tiny_pair(tmp_dir, family: str = "llama", vocab: int = 512, seed: int = 0, block_size: int = 16,
                   train_steps: int = 0, **config_kwargs) -> tuple[Path, Path]:
    """Tiny target + drafter under `tmp_dir` -> (target_dir, drafter_dir). `train_steps` > 0 trains
    the drafter briefly (about 20 ms a step) so that drafts get accepted."""
    tmp = Path(tmp_dir)
    target_dir = make_tiny_target(tmp / f"target-{family}-{vocab}-{seed}", family, vocab, seed, **config_kwargs)
    drafter_dir = make_tiny_drafter(tmp / f"drafter-{family}-{vocab}-{seed}-{train_steps}", target_dir, seed=seed,
                                    block_size=block_size, train_steps=train_steps)
    return target_dir, drafter_dir


def single_thread():
    """Generator for an autouse fixture: torch on one thread while a test module runs (tiny models
    gain nothing from threads, and a shared 2-core machine thrashes with them), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_to_completion(engine, adds=(), join_after=None) -> dict:
    """Step `engine` until every request is done; returns request_id -> generated ids, plus
    "<request_id>:stats" -> final stats. `adds` are add_request argument tuples
    (request_id, prompt, params, knobs); `join_after` maps a request_id to the engine step
    before which it joins (default 0: before the first step)."""
    outs, steps, adds = {}, 0, list(adds)
    join_after = join_after or {}
    while adds or engine.has_unfinished():
        for a in [a for a in adds if join_after.get(a[0], 0) <= steps]:
            engine.add_request(*a)
            adds.remove(a)
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                outs[o.request_id + ":stats"] = o.stats
        steps += 1
    return outs
