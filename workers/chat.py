"""Chat prompts: messages rendered with the target's chat template, and the token ids that end an
assistant turn (where chat decoding stops).

`chat_prompt_ids(tokenizer, messages)` applies the tokenizer's template with
`add_generation_prompt=True` (SmolLM2: `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`);
a tokenizer without a template gets a plain `role: content` transcript ending in `assistant:`.

`stop_ids(tokenizer, chat=True)`: the tokenizer's EOS, and for chat also the **end-of-turn**
token: the special token the template writes right after an assistant message (SmolLM2's and
Qwen's `<|im_end|>`, Llama 3's `<|eot_id|>`), found by rendering one.
"""

from __future__ import annotations

from typing import Any

_PROBE = "\u2063adapt-probe\u2063"  # text no template alters


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` ([{"role", "content"}, ...]) ready for the assistant's answer."""
    if has_template(tokenizer):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer.encode(text, add_special_tokens=False))


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template closes an assistant message with, or None."""
    if not has_template(tokenizer):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this conversation: no end-of-turn token
        return None
    tail = text[text.rfind(_PROBE) + len(_PROBE):] if _PROBE in text else ""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    specials += [str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                 if getattr(t, "special", False)]
    hits = sorted((tail.find(s), -len(s), s) for s in set(specials) if 0 <= tail.find(s) and not tail[: tail.find(s)].strip())
    if not hits:
        return None
    token_id = tokenizer.convert_tokens_to_ids(hits[0][2])
    return None if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None) else int(token_id)


def stop_ids(tokenizer: Any, chat: bool = False) -> tuple[int, ...]:
    """The tokenizer's EOS id (if any), plus the end-of-turn token for chat."""
    ids = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    if chat:
        eot = end_of_turn_id(tokenizer)
        if eot is not None:
            ids.append(eot)
    return tuple(dict.fromkeys(ids))
