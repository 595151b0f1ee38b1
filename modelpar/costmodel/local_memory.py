"""Per-rank bytes of ``modelpar train``'s own layout, exactly: parameters, gradient buffers, AdamW state, activations.

The planner's ``memory.py`` follows Megatron's accounting (everything ÷ t, 16-bit); the trainer's
ranks hold what its modules hold, as ``costmodel.inventory`` lists it (the tensors and the gradient
buckets the trainer itself checks it holds at start), and gradient buffers padded to a multiple of
d under ZeRO; an expert tensor under ep > 1, a bucket of its own, is reduced over the d/ep replicas
holding the same experts only: under ZeRO its state, gradient and parameters are cut into d/ep ranges
(``inventory.bucket_shards``). A mixture-of-experts layer keeps ``costmodel.moe.moe_activation_bytes``
in place of the SwiGLU's 4·ffn/t per token (uniform routing). ``LocalLayout`` states
a run in plain numbers (``modelpar.training.prediction.local_run`` builds it from a TrainConfig)
and these functions give the bytes its ranks measure (tests assert equality, and activations
within 10%).

Activations are what autograd saves for the backward, per microbatch and stage, in elements per
token of one layer (derived from the modules' operations, and checked against
``torch.autograd.graph.saved_tensors_hooks`` in the tests):

    GPT:   replicated 4h + 4 (norm inputs and outputs, 2 LayerNorms' mean and rstd; with sequence
           parallelism (2h + 4)/t + 2h: the norms see sequence shards, the linears' gathered inputs are whole)
           sharded (3h + h + 2·ffn)/t (fused q, k, v; attention output; GeLU input and output)
           + a/t (the attention's log-sum-exp, not kept with selective recomputation)
    Llama: replicated 6h + 2 (RMSNorm keeps its input and normalised input, and rstd; SP: (4h + 2)/t + 2h)
           sharded: q and k after rotation, v (grouped-query heads are not repeated: SDPA shares them),
           attention output h/t, log-sum-exp a/t, the SwiGLU's gate and up 2·ffn/t, SiLU(gate) and
           the product ffn/t each; plus cos and sin, 2·s·d per stage and microbatch (one table for all layers)

Widths: the products' outputs in the compute dtype (``COMPUTE_BYTES``); under bf16 autocast the residual
stream, the norms' tensors and the log-sum-exps stay fp32 (the weights' width; ZeRO-3 gathers the weights in
bf16, so there the stream is bf16 too, RMSNorm's internals fp32 still), Llama's attention norm output is
cast once for q and once for k|v, and autocast's bf16 copies of the weights (``autocast_copy_bytes``) are
kept with every held microbatch: all counted on a CPU run exactly as on a GPU (tests/cluster/test_prediction.py).

Context parallelism (cp > 1) keeps all of that for a rank's s/cp tokens. The core attention runs
inside one autograd function that repeats key/value heads itself, so k and v are kept unrepeated
(Llama's q, k rotated and the k|v output, as above); ``--cp-comm allgather`` keeps the gathered
keys and values instead, 2·cp·(kv features) per local token (GPT: besides the fused qkv output its
q still holds; Llama: in place of the rotated k and the k|v output), unless selective recomputation
keeps only the core's local inputs; the ring keeps its merged output (h/t), which the projection copies.
GPT's first stage keeps the s/cp zig-zag positions (int64) its learned positions are indexed by.

The first stage also keeps the token ids (8 bytes each), the last the final norm's, the head's
input, the targets and one fp32 log-sum-exp per token (the chunked head and loss, ``loss_chunk_mb``;
with the logits whole: the fp32 softmax V/t and 10 bytes per token of targets and masks). Full
recomputation keeps only each stage's input (h per token; ÷ t with sequence parallelism). The ids (t = 1)
and the chunked loss's targets are views of the rank's batch, one allocation that all its microbatches
share (``batch_view_bytes``): a count of held bytes takes them whole while any microbatch is held.

Activation offload (``offload``, ``offload_plan``) moves the chosen layers' own bytes to host
memory: ``offloaded_bytes``, taken off ``activation_bytes`` (the rotary cos/sin every layer shares stay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelpar.costmodel.dispatch import DispatchCounts
from modelpar.costmodel.inventory import bucket_shards, owned_range, stage_layers, stage_tensors
from modelpar.costmodel.moe import MoESpec, moe_activation_bytes
from modelpar.costmodel.specs import Dimensions, ModelSpec
from modelpar.costmodel.zero_bytes import optimizer_state_bytes_per_param
from modelpar.offload_plan import offload_layers

__all__ = ["AUTOCAST", "COMPUTE_BYTES", "PARAM_BYTES", "LocalLayout", "activation_bytes", "activation_parts",
           "autocast_copy_bytes", "batch_view_bytes", "moe_layers_of", "offloaded_bytes", "state_bytes"]

PARAM_BYTES = {"fp32": 4, "bf16": 4, "fp8": 4, "fp64": 8}  # the trainer's parameters (bf16, fp8: fp32 master weights)
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2, "fp64": 8}  # its products' outputs (fp8: bf16 between the products)
AUTOCAST = ("bf16",)  # precisions whose products read autocast's copies of fp32 parameters and inputs
_IDS = 8  # int64 token ids the embedding keeps, per token
_LOSS = 10  # bytes per token the vocabulary-parallel cross entropy keeps besides the logits


@dataclass(frozen=True, repr=False)  # Dimensions.__repr__: model, t, p, d first
class LocalLayout(Dimensions):
    """One ``modelpar train`` layout in plain numbers (Megatron notation); cp, cp_comm, ep and stage_layers are
    ``Dimensions``'s (keyword-only), the fields it shares with a published run's ``ParallelConfig``."""

    model: ModelSpec  # ``ModelConfig.spec()``: padded vocabulary, the MLP width, key/value heads
    t: int = 1
    p: int = 1
    d: int = 1
    schedule: str = "1f1b"
    v: int = 1  # chunks per pipeline rank
    microbatches: int = 4  # per replica
    batch: int = 16  # global, sequences
    recompute: str = "none"
    sequence_parallel: bool = False
    zero: int = 0
    precision: str = "fp32"
    bucket_elements: int = 1 << 22
    overlap: bool = True  # data-parallel reduction during the backward
    reshard: bool = True  # ZeRO-3: gather again for every forward and backward (``reshard_after_forward``)
    memory_limit: float = 0.0  # schedule "auto": most held activations per device, microbatches of a stage (0: any)
    moe: MoESpec | None = None  # ``ModelConfig.moe_spec()``: the MoE layers' experts (None: dense)
    chunked_loss: bool = True  # the head and loss in chunks of tokens (``loss_chunk_mb`` > 0): no logits kept
    offload: str = "none"  # activation offload to host memory: none, all, n or every-k (``offload_plan``)
    ops: DispatchCounts | None = None  # ops the run dispatches (``costmodel.dispatch``; GPU pricing); None: the constants
    compiled: bool = False  # ``--compile``: its layers priced from the profile's ``layer_compiled`` where measured

    @property
    def micro_batch(self) -> int:
        return self.batch // (self.d * self.microbatches)

    @property
    def tokens(self) -> int:
        """Tokens of one microbatch on one rank: b·s/cp."""
        return self.micro_batch * self.model.seq // self.cp

    @property
    def kv_features(self) -> int:
        """Key (or value) features a rank holds: its key/value heads (one at least, replicated beyond t) × head dim."""
        m = self.model
        return max(1, (m.kv_heads or m.heads) // self.t) * (m.hidden // m.heads)

    @property
    def param_bytes(self) -> int:
        return PARAM_BYTES[self.precision]

    @property
    def stream_bytes(self) -> int:
        """Bytes per element of the residual stream: the width of the weights the forward reads — the fp32
        masters under autocast, but ZeRO-3 gathers them in the compute dtype (``training.zero_params``)."""
        return COMPUTE_BYTES[self.precision] if self.zero >= 3 else PARAM_BYTES[self.precision]


def state_bytes(run: LocalLayout, stages: list[int], dp_rank: int = 0) -> dict[str, float]:
    """``parameters``, ``gradients`` and ``optimizer`` bytes of the rank holding ``stages`` at ``dp_rank`` (its index
    among the d·cp ranks that share its parameters: dp index · cp + cp index).

    Gradient buffers are padded to a multiple of d·cp under ZeRO (each rank owns an equal range of
    every bucket, of an expert bucket under ep > 1 one of d/ep, ``bucket_shards``; ZeRO-2 and 3 keep
    only that range); the AdamW moments cover the parameters of this rank's ranges only (no padding);
    ZeRO-3 keeps its range of every bucket's parameters, padding included
    (``ShardedGradSync.parameter_bytes``), the rest only while gathered (``dp_traffic``'s
    collectives; those transient buffers are not counted here).
    """
    w = run.param_bytes
    pad = run.grad_ranks if run.zero else 1
    params = grads = state = 0.0
    for s in stages:
        if run.zero < 3:
            params += sum(x.numel for x in stage_tensors(run, s)) * w
        for n, ranks in bucket_shards(run, s):
            size = math.ceil(n / pad) * pad
            lo, hi = owned_range(run, n, ranks, dp_rank) if run.zero else (0, size)
            grads += (hi - lo if run.zero >= 2 else size) * w
            params += (hi - lo) * w if run.zero >= 3 else 0  # ZeRO-3 keeps its range of each bucket (the fp32 master)
            state += max(0, min(hi, n) - lo) * optimizer_state_bytes_per_param(w)  # no state for the padding
    return {"parameters": params, "gradients": grads, "optimizer": state}


def _layer_elements(run: LocalLayout) -> tuple[float, float, float]:
    """Elements one layer keeps per token on one rank (module docstring), cos/sin excluded: (at the compute
    width, the norms' — ``norm_bytes`` —, the attention's log-sum-exp, fp32 at least)."""
    m, t = run.model, run.t
    h, f, a = m.hidden, m.ffn_size, m.heads
    sp = run.sequence_parallel and t > 1
    lse = 0.0 if run.recompute == "selective" else a / t
    # the norms' inputs and statistics (and RMSNorm's normalised input) are sequence shards under SP; the two
    # linear inputs they feed are all-gathered, whole
    linear_inputs = 2 * h
    local_kv = run.kv_features  # key/value features here (one head's at least)
    core = run.cp > 1 and run.recompute != "selective"  # the cp attention function keeps its own tensors
    # all-gather: the gathered keys and values; ring: its merged output, a storage of its own (the projection's
    # input is a copy of it), where the all-gather's output is laid out as the projection's input already
    gathered = 2 * run.cp * local_kv if core and run.cp_comm == "allgather" else 0.0
    gathered += h / t if core and run.cp_comm == "ring" else 0.0
    if not m.gated_mlp:
        return linear_inputs + (4 * h + 2 * f) / t + gathered, (2 * h + 4) / (t if sp else 1), lse
    if core and run.cp_comm == "allgather":  # q rotated; the local k and the k|v output are kept by nothing
        attention = h / t + gathered
    else:  # q, k rotated, the k|v output (v's): grouped-query heads share theirs inside SDPA (enable_gqa)
        attention = h / t + 3 * local_kv
    # autocast casts the attention norm's fp32 output once for each of its two products (q, and k|v): two copies
    # (not under ZeRO-3: the norm's output has its input's dtype, the compute dtype there)
    recast = h if run.precision in AUTOCAST and run.stream_bytes > COMPUTE_BYTES[run.precision] else 0
    return linear_inputs + recast + attention + h / t + 4 * f / t, (4 * h + 2) / (t if sp else 1), lse


def moe_layers_of(run: LocalLayout, stage: int) -> int:
    """How many of ``stage``'s layers are mixtures of experts."""
    if run.moe is None:
        return 0
    here = stage_layers(run, stage)
    return sum(1 for i in run.moe.layers(run.model.layers) if i in here)


def _moe_bytes(run: LocalLayout, stage: int) -> float:
    """What ``stage``'s MoE layers keep beyond a dense layer: ``costmodel.moe.moe_activation_bytes`` less the
    SwiGLU's 4·ffn/t per token that ``_layer_elements`` counted (the router keeps the same input)."""
    n = moe_layers_of(run, stage)
    if not n or run.moe is None:
        return 0.0
    e, m = COMPUTE_BYTES[run.precision], run.model
    moe = moe_activation_bytes(run.moe, run.tokens, run.micro_batch, m.hidden, run.t, e)
    return n * (moe - run.tokens * 4 * m.ffn_size / run.t * e)


def norm_bytes(run: LocalLayout) -> int:
    """Bytes per element the norms keep (their inputs, statistics, RMSNorm's normalised input): the residual
    stream's width; RMSNorm runs in fp32 under autocast (its policy's fp32 list) whatever its input."""
    if run.model.gated_mlp and run.precision in AUTOCAST:
        return max(4, run.stream_bytes)
    return run.stream_bytes


def activation_parts(run: LocalLayout, stage: int) -> tuple[float, float, float]:
    """Bytes autograd keeps for one microbatch of ``stage`` on one rank, (one layer's, the first stage's
    embedding's, the last stage's norm, head and loss's); 0 for an end ``stage`` does not hold."""
    m, t = run.model, run.t
    e = COMPUTE_BYTES[run.precision]
    tokens = run.tokens
    sp = run.sequence_parallel and t > 1
    narrow, norms, lse = _layer_elements(run)
    w = norm_bytes(run)
    layer = 0.0 if run.recompute == "full" else tokens * (narrow * e + norms * w + lse * max(e, 4))  # full: the input
    first = last = 0.0
    if stage == 0:
        first = tokens * _IDS
        first += m.seq // run.cp * _IDS if run.cp > 1 and m.learned_positions else 0  # the zig-zag position index
    if stage == run.stages - 1:
        norm = (m.hidden + 2) if m.bias else (2 * m.hidden + 1)  # at the residual stream's width, as the layers'
        if run.chunked_loss:  # the head's input cast to the compute dtype, the targets, one log-sum-exp per token
            last = tokens * (norm / (t if sp else 1) * w + m.hidden * e + _IDS + max(e, 4)) + 8
        else:  # the head's input (autocast's copy), the fp32 softmax over this rank's V/t ids, the loss's masks
            last = tokens * (norm / (t if sp else 1) * w + m.hidden * e + m.vocab / t * max(e, 4) + _LOSS) + 8
    return layer, first, last


def autocast_copy_bytes(run: LocalLayout, stage: int, layers: bool = True) -> float:
    """Bytes of autocast's bf16 weight copies one microbatch of ``stage`` keeps until its backward: 2 bytes per
    element of every weight a product reads and keeps for its backward, the layers' linears' (``layers``: False
    under full recomputation, whose layers save nothing) and the head's (not the norms'; not the biases': a
    bias's copy, where one is made, is not kept, its gradient being a sum of the output's); 0 without autocast.
    autocast casts an fp32 leaf that requires grad once per region and caches it until the outermost region
    exits (``cached_cast``, aten/src/ATen/autocast_mode.cpp; torch/amp/autocast_mode.py ``__exit__`` →
    ``clear_autocast_cache``); the products' backward nodes keep the copy, so each held microbatch holds a set
    (a stage's forward is one region: ``training.precision.MixedPrecisionStage``); the chunked loss casts the
    head's weight itself and saves it."""
    if run.precision not in AUTOCAST or run.zero >= 3:  # ZeRO-3: the weights are gathered in the compute dtype
        return 0.0
    m = run.model
    norm = m.hidden * (2 if m.bias else 1)
    elements = 0
    if layers:
        elements = sum(x.numel for x in stage_tensors(run, stage))
        up = (2 if m.gated_mlp else 1) * m.ffn_size // run.t
        biases = (0 if m.gated_mlp else 3 * m.hidden // run.t) + up + 2 * m.hidden if m.bias else 0
        elements -= (2 * norm + biases) * len(stage_layers(run, stage))
        if stage == 0:  # the embedding and positions are looked up, not multiplied
            elements -= m.vocab // run.t * m.hidden + (m.seq * m.hidden if m.learned_positions else 0)
        if stage == run.stages - 1:  # the final norm; the head's weight is counted below
            elements -= norm + (m.vocab // run.t * m.hidden if not (m.tied_embeddings and run.stages == 1) else 0)
    if stage == run.stages - 1:
        elements += m.vocab // run.t * m.hidden  # the head reads its weight (tied at p = 1: the embedding's)
    return float(elements * COMPUTE_BYTES[run.precision])


def activation_bytes(run: LocalLayout, stage: int) -> float:
    """Bytes autograd keeps for one microbatch of ``stage`` on one rank (module docstring)."""
    layer, first, last = activation_parts(run, stage)
    layers = len(stage_layers(run, stage))
    if run.recompute == "full":
        sp = run.sequence_parallel and run.t > 1
        body = run.tokens * run.model.hidden / (run.t if sp else 1) * run.stream_bytes if layers else 0.0
    else:
        body = layers * layer + _moe_bytes(run, stage)  # MoE: the experts' terms in place of the SwiGLU's
        if layers and run.model.gated_mlp:  # one rotary cos/sin for all of the stage's layers
            body += 2 * run.model.seq // run.cp * (run.model.hidden // run.model.heads) * COMPUTE_BYTES[run.precision]
    copies = autocast_copy_bytes(run, stage, layers=run.recompute != "full")  # full: cast again in the re-run
    return body + first + last + copies - offloaded_bytes(run, stage)


def batch_view_bytes(run: LocalLayout, stage: int) -> tuple[float, float]:
    """Of ``activation_bytes``, what are views of the rank's batch, (one microbatch's share, the whole batch):
    the runtime's microbatches are slices of one ids and one targets tensor (``torch.tensor_split``), so the
    int64 ids the embedding keeps (at t = 1; at t > 1 it keeps its own shifted ids) and the targets the chunked
    loss keeps (the whole-logits loss keeps its own) are one allocation each, held whole while any microbatch
    of the stage is (``schedules.memory.peak_held_bytes``'s ``shared_bytes``)."""
    ids = (stage == 0 and run.t == 1) + (stage == run.stages - 1 and run.chunked_loss)
    rows = run.batch // run.d
    return run.tokens * ids * _IDS, rows * run.model.seq // run.cp * ids * _IDS


def offloaded_bytes(run: LocalLayout, stage: int) -> float:
    """Bytes of one microbatch of ``stage`` that activation offload moves to host memory: the chosen layers' own
    (a MoE layer's with its experts' terms; autocast's copies of their weights); none under full recomputation
    (the layers save nothing then)."""
    if run.offload == "none" or run.recompute == "full":
        return 0.0
    per = run.model.layers // run.stages
    layers = len(stage_layers(run, stage))
    # a layer's own: what it saves, and autocast's copies of its weights (saved tensors too, moved with them)
    copies = autocast_copy_bytes(run, stage) - autocast_copy_bytes(run, stage, layers=False)
    layer = activation_parts(run, stage)[0] + (copies / layers if layers else 0.0)
    chosen = [stage * per + i for i in offload_layers(per, run.offload)]
    n_moe = moe_layers_of(run, stage)
    extra = _moe_bytes(run, stage) / n_moe if n_moe else 0.0
    moe = set(run.moe.layers(run.model.layers)) if run.moe is not None else set()
    return sum(layer + (extra if i in moe else 0.0) for i in chosen)
