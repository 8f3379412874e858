"""Model runtime: `ModelArgs` + presets (args.py), `Transformer` (transformer.py), `load_model` (load.py),
tokenizers (tokenizer.py)."""

from worker.tlt.model.args import PRESETS, ModelArgs, preset
from worker.tlt.model.load import load_model, random_model
from worker.tlt.model.tokenizer import ByteTokenizer, Tokenizer
from worker.tlt.model.transformer import Transformer

__all__ = ["PRESETS", "ByteTokenizer", "ModelArgs", "Tokenizer", "Transformer", "load_model", "preset", "random_model"]
