"""The built-in models by name: the one table that the job spec (which names it accepts), the control plane's
admission (context and depth, checked at submit without loading anything) and the library (worker/tlt/model/load.py)
read. Pure data, no torch: the control plane imports it.

    BUILTIN_MODELS["smollm2-135m-instruct@qwen2.5-7b"].context   # 8192

The numbers are the engine's (worker/tlt/model/args.py PRESETS, worker/tlt/model/widen.py `plan(...).args`);
tests/backend/test_cp_safety_admission.py keeps them equal, so a name added there without its shape here fails.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SMOLLM2 = "smollm2-135m-instruct"


@dataclass(frozen=True)
class BuiltinShape:
    """What admission needs to know of a built-in model before any worker loads it."""

    context: int  # longest sequence in tokens (prompt + completion)
    layers: int  # decoder layers
    hidden: int  # hidden size (sizes the drafter's hidden-state buffer per token)
    vocab: int  # vocabulary size
    # longest token in UTF-8 bytes: a text of N bytes is at least N / max_token_bytes tokens (SmolLM2: a run of 80
    # spaces and a newline; the byte tokenizer of the tiny models: 1)
    max_token_bytes: int


SMOLLM2_TOKEN_BYTES = 81
_SMOLLM2_SHAPE = BuiltinShape(context=8192, layers=30, hidden=576, vocab=49152, max_token_bytes=SMOLLM2_TOKEN_BYTES)
_TINY = BuiltinShape(context=1024, layers=2, hidden=64, vocab=320, max_token_bytes=1)

# "@NAME": SmolLM2 widened exactly into architecture NAME (worker/tlt/model/widen.py WIDEN_TARGETS); the widened model
# keeps SmolLM2's context and tokenizer and has at least its 30 layers.
WIDENED: dict[str, BuiltinShape] = {
    f"{SMOLLM2}@qwen2.5-7b": replace(_SMOLLM2_SHAPE, layers=30, hidden=3584),
    f"{SMOLLM2}@llama3-8b": replace(_SMOLLM2_SHAPE, layers=32, hidden=4096),
    f"{SMOLLM2}@llama3.2-3b": replace(_SMOLLM2_SHAPE, layers=30, hidden=3072),
    f"{SMOLLM2}@test": replace(_SMOLLM2_SHAPE, layers=31, hidden=640),
}

BUILTIN_MODELS: dict[str, BuiltinShape] = {
    SMOLLM2: _SMOLLM2_SHAPE, "tiny-llama": _TINY, "tiny-qwen2": _TINY, "tiny-qwen3": _TINY, **WIDENED,
}
BUILTIN_MODEL_NAMES = tuple(BUILTIN_MODELS)
WIDENED_MODEL_NAMES = tuple(WIDENED)
