"""``ModelConfig``: the shape of a decoder-only transformer, GPT-2 or Llama style, and its checks.

The parameter and FLOP counts come from the cost model's ``ModelSpec`` of the same numbers, so
what `modelpar train` reports is what `modelpar plan` assumes (tests count the real modules).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from modelpar._options import construct, option
from modelpar._validate import check_choice, check_divisible, check_int, check_number
from modelpar.costmodel.specs import ModelSpec
from modelpar.layer_split import split_layers

__all__ = ["ARCHS", "VOCAB_MULTIPLE", "ModelConfig"]

ARCHS = ("gpt", "llama")
VOCAB_MULTIPLE = 64  # the embedding and output layer hold the vocabulary padded to a multiple of this


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer. Defaults: the `modelpar train` demo GPT (867,072 parameters, bytes).

    ``arch="gpt"``: pre-LayerNorm, learned positions, multi-head attention, GeLU MLP, biases.
    ``arch="llama"``: RMSNorm, rotary positions, grouped-query attention (``kv_heads``), SwiGLU
    MLP, no biases (Touvron et al. 2023), laid out as Hugging Face's ``LlamaForCausalLM``.
    """

    vocab_size: int = option(256, cli=False, help="V: the tokenizer's vocabulary (set by --tokenizer); the embedding "
                                                 "and the output layer hold it padded to a multiple of 64")
    seq_len: int = option(64, help="s: context length (gpt: also the number of learned positions)")
    hidden: int = option(128, help="h: model width, divisible by heads")
    heads: int = option(4, help="a: attention (query) heads, divisible by t (heads are split across ranks)")
    layers: int = option(4, help="L: transformer layers, split over the p·v (virtual) stages as --stage-layers says")
    ffn: int = option(0, help="MLP width; 0: the arch's default, 4h (gpt) or 8h/3 rounded up to a multiple of 64 (llama)")
    tie_embeddings: bool = option(False, help="the output layer reuses the input embedding (summed across stages if p > 1)")
    init_std: float = option(0.02, help="N(0, std) for weights (GPT-2); output projections scaled by 1/sqrt(2L)")
    arch: str = option("gpt", help="gpt (LayerNorm, learned positions, GeLU, biases) or llama (RMSNorm, rotary, "
                                   "SwiGLU, grouped-query attention, no biases)")
    kv_heads: int = option(0, help="key/value heads of grouped-query attention (llama); 0: one per query head")
    norm_eps: float = option(1e-5, help="epsilon of LayerNorm (gpt) / RMSNorm (llama)")
    rope_theta: float = option(10000.0, help="rotary embedding base (llama)")

    @property
    def ffn_hidden(self) -> int:
        """The MLP width: ``ffn``, or 4h (gpt), or 8h/3 rounded up to a multiple of 64 (llama)."""
        if self.ffn:
            return self.ffn
        return 4 * self.hidden if self.arch == "gpt" else -(-8 * self.hidden // (3 * 64)) * 64

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads: ``kv_heads``, or ``heads`` when 0 (multi-head attention)."""
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and output layer: V rounded up to a multiple of 64, the same for every t."""
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def spec(self) -> ModelSpec:
        """The cost model's description of this model (padded vocabulary: the head computes those rows)."""
        gpt = self.arch == "gpt"
        return ModelSpec(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq_len,
                         vocab=self.padded_vocab_size, ffn=self.ffn_hidden, kv_heads=self.num_kv_heads,
                         gated_mlp=not gpt, tied_embeddings=self.tie_embeddings, learned_positions=gpt, bias=gpt,
                         dropout=False, name=f"modelpar-{self.arch}")

    def num_parameters(self) -> int:
        """Parameters of the single-process model (a tied head counts once): the cost model's count
        plus the final norm, which Megatron's formula leaves out (2h for LayerNorm, h for RMSNorm)."""
        return round(self.spec().params) + (2 if self.arch == "gpt" else 1) * self.hidden

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward, no recomputation): the MFU numerator."""
        return self.spec().model_flops(1)

    def check(self, tp: int = 1, stages: int = 1, sequence_parallel: bool = False) -> ModelConfig:
        """Raise ValueError unless the shape is valid and splits across t ranks and ``stages`` (p·v) stages."""
        check_choice("arch", self.arch, ARCHS)
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("ffn", self.ffn, minimum=0)
        check_int("kv_heads", self.kv_heads, minimum=0)
        check_number("norm_eps", self.norm_eps, 0.0, strict=True)
        check_number("rope_theta", self.rope_theta, 0.0, strict=True)
        check_number("init_std", self.init_std)
        check_divisible("hidden", self.hidden, "heads", self.heads)
        if self.arch == "gpt" and self.num_kv_heads != self.heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) needs arch 'llama' (the GPT's attention is multi-head)")
        check_divisible("heads", self.heads, "kv_heads", self.num_kv_heads)
        if self.arch == "llama":
            check_divisible("head dimension (hidden / heads, rotary embedding)", self.head_dim, "2", 2)
        check_divisible("heads", self.heads, "tp", tp)
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"kv_heads ({self.num_kv_heads}) and tp ({tp}) must divide one another (key/value "
                             "heads are split across t ranks when kv_heads >= t and replicated when t > kv_heads)")
        check_divisible(f"padded vocabulary (vocab_size {self.vocab_size} rounded up to a multiple of "
                        f"{VOCAB_MULTIPLE})", self.padded_vocab_size, "tp", tp)
        check_divisible("ffn hidden size", self.ffn_hidden, "tp", tp)
        split_layers(self.layers, stages)  # at most the first and the last stage without a layer
        if sequence_parallel:
            check_divisible("seq_len (sequence parallel)", self.seq_len, "tp", tp)
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The config a ``to_dict`` wrote; an unknown field is a ValueError naming it and the known ones."""
        return construct(cls, values, "model config:")
