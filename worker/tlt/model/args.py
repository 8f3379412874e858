"""Model shape: `ModelArgs` (a frozen dataclass) and a table of named presets.

`ModelArgs.from_hf_config(dict)` reads an HF `config.json` (Llama / Qwen2 / Qwen3); `PRESETS[name]` gives the tiny
random test models and the SmolLM2-135M shape; `SHAPES[name]` the real architectures users train (random-weight
benchmarks, widened targets). Nothing here touches torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

ARCHS = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in HF `rope_scaling` ("linear" or "llama3")."""

    kind: str = "none"  # none | linear | llama3
    factor: float = 1.0  # linear: positions divided by this; llama3: low-frequency wavelengths scaled by this
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelArgs:
    arch: str = "llama"  # llama | qwen2 (q/k/v bias) | qwen3 (per-head q/k RMSNorm)
    vocab_size: int = 32000  # rows of the embedding / lm_head
    dim: int = 4096  # hidden size H
    n_layers: int = 32  # decoder layers L
    n_heads: int = 32  # query heads
    n_kv_heads: int = 32  # key/value heads (GQA when < n_heads)
    head_dim: int = 0  # 0 = dim // n_heads (Qwen3 may set it explicitly)
    intermediate_size: int = 11008  # SwiGLU hidden width
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # none unless the checkpoint says so
    max_seq_len: int = 4096  # rows of the RoPE table (positions must stay below it)
    tie_word_embeddings: bool = False  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # Qwen2 family
    qk_norm: bool = False  # Qwen3 family
    bos_token_id: int | None = None  # informative; the tokenizer decides what to prepend
    eos_token_ids: tuple[int, ...] = ()  # from config.json / GGUF metadata

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        mt = cfg.get("model_type", "llama")
        arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama"}.get(mt)
        if arch is None:
            raise ValueError(f"unsupported model_type {mt!r}; supported: llama, mistral, qwen2, qwen3")
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rtype = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
        if rtype in ("default", None):
            scaling = RopeScaling()
        elif rtype in ("linear", "llama3"):
            scaling = RopeScaling(
                kind=rtype,
                factor=float(rs.get("factor", 1.0)),
                low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
            )
        else:
            raise ValueError(f"unsupported rope scaling {rtype!r}; supported: linear, llama3")
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        n_heads = int(cfg["num_attention_heads"])
        return cls(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or 0),
            intermediate_size=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_seq_len=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF config.json dict for this shape (used by exports and by the transformers parity tests)."""
        model_type = self.arch
        arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.arch]
        cfg: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.hd,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        }
        if self.arch == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = False
        if self.rope_scaling.kind != "none":
            rs = self.rope_scaling
            cfg["rope_scaling"] = {"rope_type": rs.kind, "factor": rs.factor}
            if rs.kind == "llama3":
                cfg["rope_scaling"].update(
                    low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings,
                )
        if self.bos_token_id is not None:
            cfg["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            cfg["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return cfg


_TINY = dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128, max_seq_len=1024,
             rope_theta=10000.0, norm_eps=1e-6, eos_token_ids=(257,), bos_token_id=256)

# Named presets. tiny-* are random test models (byte tokenizer ids 0..258 fit in vocab 320).
PRESETS: dict[str, ModelArgs] = {
    "tiny-llama": ModelArgs(arch="llama", tie_word_embeddings=True, **_TINY),  # type: ignore[arg-type]
    "tiny-qwen2": ModelArgs(arch="qwen2", qkv_bias=True, **_TINY),  # type: ignore[arg-type]
    "tiny-qwen3": ModelArgs(arch="qwen3", qk_norm=True, head_dim=32, **_TINY),  # type: ignore[arg-type]
    # SmolLM2-135M(-Instruct): Llama, 30 layers, hidden 576, GQA 9/3, vocab 49152, tied embeddings.
    "smollm2-135m": ModelArgs(
        arch="llama", vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
        norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,),
    ),
}

# Real architectures people train, for random-weight speed measurements (`shape:NAME`) and for widening SmolLM2
# into a target of that cost. Shapes from the public config.json of each model; the vocabulary is kept at
# SmolLM2's 49,152 so a widened target can carry SmolLM2's tokenizer (the head's cost is stated where it matters).
_REAL_VOCAB = 49152
SHAPES: dict[str, ModelArgs] = {
    "qwen2.5-1.5b": ModelArgs(
        arch="qwen2", vocab_size=_REAL_VOCAB, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_size=8960,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, tie_word_embeddings=True, qkv_bias=True,
    ),
    "llama3.2-3b": ModelArgs(
        arch="llama", vocab_size=_REAL_VOCAB, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, intermediate_size=8192,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=131072, tie_word_embeddings=True,
        rope_scaling=RopeScaling(kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
    ),
    "qwen2.5-7b": ModelArgs(
        arch="qwen2", vocab_size=_REAL_VOCAB, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_size=18944,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, tie_word_embeddings=False, qkv_bias=True,
    ),
    "llama3-8b": ModelArgs(
        arch="llama", vocab_size=_REAL_VOCAB, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
        norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_word_embeddings=False,
    ),
    "qwen3-8b": ModelArgs(
        arch="qwen3", vocab_size=_REAL_VOCAB, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate_size=12288, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=40960, tie_word_embeddings=False,
        qk_norm=True,
    ),
}


def shape(name: str, **overrides: Any) -> ModelArgs:
    """A real architecture by name (`SHAPES`), e.g. `shape("qwen2.5-7b")`."""
    if name not in SHAPES:
        raise KeyError(f"unknown architecture {name!r}; known: {', '.join(SHAPES)}")
    return replace(SHAPES[name], **overrides)


def preset(name: str, **overrides: Any) -> ModelArgs:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return replace(PRESETS[name], **overrides)
