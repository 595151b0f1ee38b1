"""Per-rank bytes of ``modelpar train``'s own layout, exactly: parameters, gradient buffers, AdamW state, activations.

The planner's ``memory.py`` follows Megatron's accounting (everything ÷ t, 16-bit); the trainer's
ranks hold what its modules hold: replicated norms and row-parallel biases, key/value heads
replicated when t > kv_heads, the final norm, a separate copy of a tied embedding on the last
stage, and gradient buffers in buckets padded to a multiple of d under ZeRO. A mixture-of-experts
layer (``moe``) holds ``costmodel.moe.moe_layer_tensors`` in place of the MLP: the router and the
routed experts replicated over t, E/ep experts each; under ep > 1 each expert tensor is a bucket of
its own, reduced after the step (``GradSync``), as a tied copy is, and over the d/ep replicas holding
the same experts only: under ZeRO its state, gradient and parameters are cut into d/ep ranges
(``bucket_shards``, the one place that rule lives here); it keeps ``costmodel.moe.moe_activation_bytes``
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
recomputation keeps only each stage's input (h per token; ÷ t with sequence parallelism).

Activation offload (``offload``, ``recompute.offload_plan``) moves the chosen layers' own bytes to host
memory: ``offloaded_bytes``, taken off ``activation_bytes`` (the rotary cos/sin every layer shares stay).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modelpar.costmodel.moe import MoESpec, moe_activation_bytes, moe_layer_tensors
from modelpar.costmodel.specs import ModelSpec, RankGrid
from modelpar.costmodel.zero_bytes import optimizer_state_bytes_per_param
from modelpar.recompute.offload_plan import offload_layers

__all__ = ["COMPUTE_BYTES", "PARAM_BYTES", "LocalLayout", "activation_bytes", "activation_parts", "bucket_shards",
           "moe_layers_of", "offloaded_bytes", "stage_bucket_list", "stage_buckets", "stage_tensors", "state_bytes"]

PARAM_BYTES = {"fp32": 4, "bf16": 4, "fp8": 4, "fp64": 8}  # the trainer's parameters (bf16, fp8: fp32 master weights)
COMPUTE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 2, "fp64": 8}  # its activations (fp8: bf16 between the products)
_IDS = 8  # int64 token ids the embedding keeps, per token
_LOSS = 10  # bytes per token the vocabulary-parallel cross entropy keeps besides the logits


@dataclass(frozen=True)
class LocalLayout(RankGrid):
    """One ``modelpar train`` layout in plain numbers (Megatron notation)."""

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
    cp: int = 1  # context-parallel ranks: each holds s/cp tokens of every sequence
    cp_comm: str = "ring"  # how attention sees the whole sequence (``costmodel.context``)
    moe: MoESpec | None = None  # ``ModelConfig.moe_spec()``: the MoE layers' experts (None: dense)
    ep: int = 1  # expert-parallel ranks (folded into d)
    chunked_loss: bool = True  # the head and loss in chunks of tokens (``loss_chunk_mb`` > 0): no logits kept
    offload: str = "none"  # activation offload to host memory: none, all, n or every-k (``recompute.offload_plan``)

    @property
    def stages(self) -> int:
        return self.p * self.v

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


@dataclass(frozen=True)
class _Tensor:
    numel: int
    partial: bool  # its gradient is summed over the tensor-parallel group first (own bucket group)
    tied: bool = False  # a copy of a tied embedding split across stages, or expert weights under ep > 1 (a bucket of its own)
    expert: bool = False  # routed expert weights under ep > 1: reduced and sharded over the d/ep replicas holding them


def _norm(run: LocalLayout, partial: bool) -> list[_Tensor]:
    h = run.model.hidden
    return [_Tensor(h, partial)] * (2 if run.model.bias else 1)


def _layer(run: LocalLayout, index: int) -> list[_Tensor]:
    """Layer ``index``'s parameters on one rank, in the module's order."""
    m, t = run.model, run.t
    h, f, a = m.hidden, m.ffn_size, m.heads
    kv = m.kv_heads or a
    d = h // a
    sp = run.sequence_parallel and t > 1  # replicated parameters see a sequence shard: partial gradients
    bias = m.bias
    out = list(_norm(run, sp))
    if not m.gated_mlp:  # GPT: fused qkv
        out += [_Tensor(3 * h // t * h, False)] + ([_Tensor(3 * h // t, False)] if bias else [])
    else:
        kv_replicated = t > kv
        out += [_Tensor(h // t * h, False), _Tensor(2 * max(1, kv // t) * d * h, t > 1 and kv_replicated)]
    out += [_Tensor(h * h // t, False)] + ([_Tensor(h, sp)] if bias else [])
    out += _norm(run, sp)
    if run.moe is not None and index in run.moe.layers(m.layers):
        e = run.moe
        split = run.ep > 1
        return out + [_Tensor(n, False, kind == "expert" and split, kind == "expert" and split)
                      for kind, n in moe_layer_tensors(h, e.experts, e.ffn, e.shared, t, run.ep)]
    up = (2 if m.gated_mlp else 1) * f // t
    out += [_Tensor(up * h, False)] + ([_Tensor(up, False)] if bias else [])
    out += [_Tensor(h * f // t, False)] + ([_Tensor(h, sp)] if bias else [])
    return out


def stage_tensors(run: LocalLayout, stage: int) -> list[_Tensor]:
    """The parameters of (virtual) stage ``stage`` on one rank, in ``module.parameters()`` order."""
    m, t, last = run.model, run.t, run.stages - 1
    split = m.tied_embeddings and run.stages > 1
    sp = run.sequence_parallel and t > 1
    out: list[_Tensor] = []
    if stage == 0:
        out.append(_Tensor(m.vocab // t * m.hidden, False, split))
        if m.learned_positions:
            out.append(_Tensor(m.seq * m.hidden, sp))
    per = m.layers // run.stages
    for i in range(stage * per, (stage + 1) * per):
        out += _layer(run, i)
    if stage == last:
        out += _norm(run, sp)
        if not (m.tied_embeddings and run.stages == 1):  # one stage: the head shares the embedding
            out.append(_Tensor(m.vocab // t * m.hidden, False, split))
    return out


def _groups(sizes: list[int], elements: int) -> list[int]:
    """Consecutive groups of at most ``elements`` (a larger tensor alone), as the trainer's buckets group them."""
    groups: list[int] = []
    fill = 0
    for n in sizes:
        if not groups or (fill + n > elements and groups[-1]):
            groups.append(0)
            fill = 0
        groups[-1] += n
        fill += n
    return groups


def stage_buckets(run: LocalLayout, stage: int) -> list[int]:
    """Elements of each gradient bucket of ``stage`` (before padding): the parameters in reverse, the
    ones reduced at once first, then the partial ones, then each tied copy (and expert tensor under ep > 1) alone."""
    return [n for n, _ in bucket_shards(run, stage)]


def bucket_shards(run: LocalLayout, stage: int) -> list[tuple[int, int]]:
    """(elements, ranks sharing it) of each gradient bucket of ``stage``, in ``stage_buckets``' order: a bucket is
    reduced, and under ZeRO sharded, over the d·cp ranks holding the same parameters; an expert tensor under
    ep > 1 over the d/ep replicas holding the same experts (``GradSync.shard_of``). Under ZeRO every buffer is
    padded to a multiple of d·cp (a multiple of d/ep too)."""
    return [(n, ranks) for n, ranks, _ in stage_bucket_list(run, stage)]


def stage_bucket_list(run: LocalLayout, stage: int) -> list[tuple[int, int, str]]:
    """(elements, ranks sharing it, ready) of each gradient bucket of ``stage`` in ``bucket_shards``' order, with
    when the trainer may reduce it (``training.buckets.READY``): "backward" as its gradients are final in the
    stage's last backward, "stage" after that backward's tensor-parallel sum, "step" after the pipeline step."""
    tensors = list(reversed(stage_tensors(run, stage)))
    plain = [x.numel for x in tensors if not x.tied and not x.partial]
    partial = [x.numel for x in tensors if not x.tied and x.partial]
    ranks = run.grad_ranks
    return ([(n, ranks, "backward") for n in _groups(plain, run.bucket_elements)]
            + [(n, ranks, "stage") for n in _groups(partial, run.bucket_elements)]
            + [(x.numel, ranks // run.ep if x.expert else ranks, "step") for x in stage_tensors(run, stage) if x.tied])


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
            shards = ranks if run.zero else 1
            index = dp_rank if ranks == run.grad_ranks else dp_rank // run.ep  # among the d/ep holding the experts
            size = math.ceil(n / pad) * pad
            per = size // shards
            grads += (per if run.zero >= 2 else size) * w
            params += per * w if run.zero >= 3 else 0  # ZeRO-3 keeps its range of each bucket (the fp32 master)
            owned = n if not run.zero else max(0, min(per, n - index * per))
            state += owned * optimizer_state_bytes_per_param(w)
    return {"parameters": params, "gradients": grads, "optimizer": state}


def _layer_elements(run: LocalLayout) -> float:
    """Elements one layer keeps per token on one rank (module docstring), cos/sin excluded."""
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
        return (2 * h + 4) / (t if sp else 1) + linear_inputs + (4 * h + 2 * f) / t + lse + gathered
    if core and run.cp_comm == "allgather":  # q rotated; the local k and the k|v output are kept by nothing
        attention = h / t + gathered
    else:  # q, k rotated, the k|v output (v's): grouped-query heads share theirs inside SDPA (enable_gqa)
        attention = h / t + 3 * local_kv
    return (4 * h + 2) / (t if sp else 1) + linear_inputs + attention + h / t + lse + 4 * f / t


def moe_layers_of(run: LocalLayout, stage: int) -> int:
    """How many of ``stage``'s layers are mixtures of experts."""
    if run.moe is None:
        return 0
    per = run.model.layers // run.stages
    return sum(1 for i in run.moe.layers(run.model.layers) if stage * per <= i < (stage + 1) * per)


def _moe_bytes(run: LocalLayout, stage: int) -> float:
    """What ``stage``'s MoE layers keep beyond a dense layer: ``costmodel.moe.moe_activation_bytes`` less the
    SwiGLU's 4·ffn/t per token that ``_layer_elements`` counted (the router keeps the same input)."""
    n = moe_layers_of(run, stage)
    if not n or run.moe is None:
        return 0.0
    e, m = COMPUTE_BYTES[run.precision], run.model
    moe = moe_activation_bytes(run.moe, run.tokens, run.micro_batch, m.hidden, run.t, e)
    return n * (moe - run.tokens * 4 * m.ffn_size / run.t * e)


def activation_parts(run: LocalLayout, stage: int) -> tuple[float, float, float]:
    """Bytes autograd keeps for one microbatch of ``stage`` on one rank, (one layer's, the first stage's
    embedding's, the last stage's norm, head and loss's); 0 for an end ``stage`` does not hold."""
    m, t = run.model, run.t
    e = COMPUTE_BYTES[run.precision]
    tokens = run.tokens
    sp = run.sequence_parallel and t > 1
    layer = 0.0 if run.recompute == "full" else tokens * _layer_elements(run) * e  # full: the stage's input only
    first = last = 0.0
    if stage == 0:
        first = tokens * _IDS
        first += m.seq // run.cp * _IDS if run.cp > 1 and m.learned_positions else 0  # the zig-zag position index
    if stage == run.stages - 1:
        norm = (m.hidden + 2) if m.bias else (2 * m.hidden + 1)
        if run.chunked_loss:  # the head's input, the targets and one log-sum-exp per token (at least fp32)
            last = tokens * ((norm / (t if sp else 1) + m.hidden) * e + _IDS + max(e, 4)) + 8
        else:  # and the fp32 softmax over this rank's V/t ids, the loss's masks
            last = tokens * ((norm / (t if sp else 1) + m.hidden + m.vocab / t) * e + _LOSS) + 8
    return layer, first, last


def activation_bytes(run: LocalLayout, stage: int) -> float:
    """Bytes autograd keeps for one microbatch of ``stage`` on one rank (module docstring)."""
    layer, first, last = activation_parts(run, stage)
    layers = run.model.layers // run.stages
    if run.recompute == "full":
        sp = run.sequence_parallel and run.t > 1
        body = run.tokens * run.model.hidden / (run.t if sp else 1) * COMPUTE_BYTES[run.precision] if layers else 0.0
    else:
        body = layers * layer + _moe_bytes(run, stage)  # MoE: the experts' terms in place of the SwiGLU's
        if layers and run.model.gated_mlp:  # one rotary cos/sin for all of the stage's layers
            body += 2 * run.model.seq // run.cp * (run.model.hidden // run.model.heads) * COMPUTE_BYTES[run.precision]
    return body + first + last - offloaded_bytes(run, stage)


def offloaded_bytes(run: LocalLayout, stage: int) -> float:
    """Bytes of one microbatch of ``stage`` that activation offload moves to host memory: the chosen layers' own
    (a MoE layer's with its experts' terms); none under full recomputation (the layers save nothing then)."""
    if run.offload == "none" or run.recompute == "full":
        return 0.0
    layer = activation_parts(run, stage)[0]
    per = run.model.layers // run.stages
    chosen = [stage * per + i for i in offload_layers(per, run.offload)]
    n_moe = moe_layers_of(run, stage)
    extra = _moe_bytes(run, stage) / n_moe if n_moe else 0.0
    moe = set(run.moe.layers(run.model.layers)) if run.moe is not None else set()
    return sum(layer + (extra if i in moe else 0.0) for i in chosen)
