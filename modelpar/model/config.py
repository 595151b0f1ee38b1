"""``ModelConfig``: the shape of a decoder-only transformer, GPT-2 or Llama style, and its checks.

The parameter and FLOP counts come from the cost model's ``ModelSpec`` of the same numbers, so
what `modelpar train` reports is what `modelpar plan` assumes (tests count the real modules).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from modelpar._options import construct, option
from modelpar._validate import check_choice, check_divisible, check_int, check_number
from modelpar.costmodel.moe import MoESpec, active_moe_layer_params, moe_layer_params, moe_layers
from modelpar.costmodel.specs import ModelSpec
from modelpar.layer_split import split_layers

__all__ = ["ARCHS", "ROUTERS", "VOCAB_MULTIPLE", "ModelConfig", "parse_capacity"]

ARCHS = ("gpt", "llama")
VOCAB_MULTIPLE = 64  # the embedding and output layer hold the vocabulary padded to a multiple of this
ROUTERS = ("softmax", "sigmoid")  # mixture-of-experts gate functions (modelpar.model.moe)


def parse_capacity(text: str) -> float | None:
    """``--capacity-factor``: a number, or none (dropless)."""
    return None if str(text).lower() == "none" else float(text)


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
    experts: int = option(0, help="E: routed experts of each mixture-of-experts layer (llama; docs/moe.md); 0: dense "
                                  "MLPs")
    top_k: int = option(2, help="k: experts each token is routed to (1 <= k <= experts)")
    shared_experts: int = option(0, help="S: always-on shared experts of each MoE layer (DeepSeek, Qwen-MoE)")
    moe_every: int = option(1, help="N: layers i with (i + 1) % N == 0 are MoE layers (1: every layer)")
    expert_ffn: int = option(0, help="F: each expert's SwiGLU width; 0: the ffn width")
    router: str = option("softmax", help="gate function: softmax (Mixtral: top-k of the softmax, renormalised) or "
                                         "sigmoid (DeepSeek-V3: top-k of sigmoid scores, renormalised)")
    aux_loss_coef: float = option(0.01, help="weight of the load-balancing loss (Switch form, per sequence)")
    capacity_factor: float | None = option(None, parse=parse_capacity, metavar="CF|none",
                                           help="per sequence an expert takes at most ceil(CF*s*k/E) assignments, "
                                                "the rest are dropped (counted); none: dropless")

    @property
    def ffn_hidden(self) -> int:
        """The MLP width: ``ffn``, or 4h (gpt), or 8h/3 rounded up to a multiple of 64 (llama)."""
        if self.ffn:
            return self.ffn
        return 4 * self.hidden if self.arch == "gpt" else -(-8 * self.hidden // (3 * 64)) * 64

    @property
    def expert_ffn_hidden(self) -> int:
        """Each expert's SwiGLU width: ``expert_ffn``, or the MLP width."""
        return self.expert_ffn or self.ffn_hidden

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global indices of the mixture-of-experts layers (none when ``experts`` is 0)."""
        if not self.experts:
            return ()
        return moe_layers(self.layers, self.moe_every)

    def _moe_delta(self) -> tuple[int, int]:
        """(parameters, forward FLOPs per token) the MoE layers add over dense MLPs: the router, E experts
        (k + S of them active per token) instead of one SwiGLU of the ffn width."""
        n, dense = len(self.moe_layers), 3 * self.hidden * self.ffn_hidden
        if not n:
            return 0, 0
        args = (self.hidden, self.experts, self.expert_ffn_hidden)
        params = n * (moe_layer_params(*args, shared=self.shared_experts) - dense)
        active = n * (active_moe_layer_params(self.hidden, self.experts, self.top_k, self.expert_ffn_hidden,
                                              shared=self.shared_experts) - dense)
        return params, 2 * active

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

    def moe_spec(self) -> MoESpec | None:
        """The cost model's description of the mixture of experts (None: dense MLPs)."""
        if not self.experts:
            return None
        return MoESpec(self.experts, self.expert_ffn_hidden, self.shared_experts, self.moe_every, self.top_k,
                       self.capacity_factor, self.router)

    def num_parameters(self) -> int:
        """Parameters of the single-process model (a tied head counts once): the cost model's count
        plus the final norm, which Megatron's formula leaves out (2h for LayerNorm, h for RMSNorm)."""
        return round(self.spec().params) + (2 if self.arch == "gpt" else 1) * self.hidden + self._moe_delta()[0]

    def flops_per_token(self) -> float:
        """Model FLOPs per trained token (forward + backward, no recomputation): the MFU numerator
        (MoE layers: the router and the k + S experts a token uses)."""
        return self.spec().model_flops(1) + 3 * self._moe_delta()[1]

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
        self._check_moe()
        split_layers(self.layers, stages)  # at most the first and the last stage without a layer
        if sequence_parallel:
            check_divisible("seq_len (sequence parallel)", self.seq_len, "tp", tp)
        return self

    def _check_moe(self) -> None:
        for name in ("experts", "shared_experts", "expert_ffn"):
            check_int(name, getattr(self, name), minimum=0)
        check_int("moe_every", self.moe_every, minimum=1)
        check_choice("router", self.router, ROUTERS)
        check_number("aux_loss_coef", self.aux_loss_coef)
        if not self.experts:
            return
        if self.arch != "llama":
            raise ValueError(f"experts ({self.experts}) needs arch 'llama' (SwiGLU experts), got arch {self.arch!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be an integer from 1 to experts ({self.experts}), got {self.top_k!r}")
        if self.capacity_factor is not None:
            check_number("capacity_factor", self.capacity_factor, 0.0, strict=True)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """The config a ``to_dict`` wrote; an unknown field is a ValueError naming it and the known ones."""
        return construct(cls, values, "model config:")
