"""Model shapes for the planner: a Llama-style decoder's FLOPs, parameters and activation bytes per pipeline
layer (:class:`Shape`; its MLPs dense, or routed experts as Mixtral, Qwen2-MoE and Qwen3-MoE have them), and the
named shapes ``--model`` picks from (:data:`MODELS`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Optional

from lightning_async_pp.plan.balanced import LayerCost


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder (RMSNorm, grouped-query attention, SwiGLU MLP, tied embedding and head, or, with
    ``tied=False``, an embedding and a head of their own: the stages hold the same bytes either way).

    With ``experts`` > 0 every block's MLP is a mixture of experts as transformers' Mixtral, Qwen2-MoE and Qwen3-MoE
    and ``models.Llama(num_experts=...)`` build it: a router (``hidden x experts``, no bias), ``experts`` SwiGLU
    experts ``expert_intermediate`` wide (default ``intermediate``), ``experts_per_token`` of them per token, and,
    with ``shared_intermediate``, Qwen2-MoE's shared SwiGLU expert of that width and its sigmoid gate (``hidden``
    weights). ``head_size``: the attention heads' width where it is not ``hidden / heads`` (Qwen3's 128);
    ``qk_norm``: Qwen3's RMSNorm of each query and key head (``head_dim`` weights each)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq_len: int
    tied: bool = True
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    head_size: int = 0
    qk_norm: bool = False

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def expert_width(self) -> int:
        return self.expert_intermediate or self.intermediate

    @property
    def active_intermediate(self) -> int:
        """The MLP width a token goes through: ``intermediate``, or its ``experts_per_token`` experts' and the
        shared expert's."""
        if not self.experts:
            return self.intermediate
        return self.experts_per_token * self.expert_width + self.shared_intermediate

    def attention_matrices(self) -> int:
        """Parameters of one block's q, k, v, o projections."""
        return 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim

    def attention_parameters(self) -> int:
        """:meth:`attention_matrices` and the norms: the block's input norm, Qwen3's query and key norms."""
        return self.attention_matrices() + self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def expert_parameters(self) -> int:
        """Parameters of one MLP's routed experts (0 for a dense MLP): what expert parallelism divides."""
        return self.experts * 3 * self.hidden * self.expert_width

    def mlp_matrices(self) -> int:
        """Parameters of one block's MLP matrices: the dense SwiGLU's three, or the router, the routed experts and
        a shared expert with its gate."""
        h = self.hidden
        if not self.experts:
            return 3 * h * self.intermediate
        shared = 3 * h * self.shared_intermediate + h if self.shared_intermediate else 0
        return h * self.experts + self.expert_parameters() + shared

    def attention_flops(self) -> int:
        """Forward FLOPs per token of one block's attention: the q, k, v, o projections (2 FLOPs per weight) and
        the scores and weighted values, 4 * seq_len * hidden (causal masking not discounted)."""
        return 2 * self.attention_matrices() + 4 * self.seq_len * self.q_dim

    def mlp_flops(self) -> int:
        """Forward FLOPs per token of one block's SwiGLU MLP: three hidden x intermediate matrices; routed, the
        router, ``experts_per_token`` experts and the shared expert with its gate."""
        h = self.hidden
        if not self.experts:
            return 2 * 3 * h * self.intermediate
        shared = 2 * (3 * h * self.shared_intermediate + h) if self.shared_intermediate else 0
        return 2 * h * self.experts + 2 * 3 * h * self.expert_width * self.experts_per_token + shared

    def head_flops(self) -> int:
        """Forward FLOPs per token of the output projection (the loss's softmax is negligible)."""
        return 2 * self.hidden * self.vocab

    def parameters(self) -> int:
        h = self.hidden
        block = self.attention_parameters() + self.mlp_matrices() + h
        return self.layers * block + self.vocab * h * (1 if self.tied else 2) + h

    def layer_parameters(self, split_blocks: bool) -> list[int]:
        """Parameters of each pipeline layer, as :meth:`pipeline_layers` splits them. The tied embedding/head is
        held (and its gradient reduced) by the first and by the last layer's stage; the final norm goes last."""
        h = self.hidden
        params = self._per_layer(self.attention_parameters(), self.mlp_matrices() + h, split_blocks)
        params[0] += self.vocab * h
        params[-1] += self.vocab * h + h
        return params

    def shared_parameters(self, split_blocks: bool, param_bytes: int = 1,
                          tensor_parallel_size: int = 1) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The tied embedding and head (``tied``), which the first and the last pipeline layer both count
        (:meth:`layer_parameters`): its bytes (one tensor-parallel rank's share) and those layers, so that a stage
        holding both counts it once (``MemoryModel.param_shared``)."""
        last = len(self.pipeline_layers(split_blocks)) - 1
        if not self.tied or last == 0:
            return ()
        return ((round(self.vocab * self.hidden / tensor_parallel_size * param_bytes), (0, last)),)

    def layer_matrix_parameters(self, split_blocks: bool) -> list[int]:
        """Of :meth:`layer_parameters`, those in the blocks' hidden matrices (the projections: what Muon
        orthogonalizes); the rest are the embedding, the head and the norms."""
        return self._per_layer(self.attention_matrices(), self.mlp_matrices(), split_blocks)

    def layer_saved_bytes(self, split_blocks: bool, tokens: int, value_bytes: int) -> list[int]:
        """Bytes each pipeline layer keeps for its backward over a microbatch of ``tokens`` (whole sequences), as
        transformers' Llama layers do under SDPA's causal kernel (``HuggingFaceCausalLM``; a test counts them):
        an RMSNorm its input in fp32, the reciprocal RMS (fp32) and two tensors of ``value_bytes``; attention the
        rotated queries and its output, the rotated keys and the values, a log-sum-exp per head (fp32) and the
        rotary cos and sin once per position; the SwiGLU MLP four intermediate-wide tensors; the embedding the
        token ids; the last layer the final norm, the head's input and the loss's log-probabilities (fp32).
        Qwen3's query and key norms keep their inputs. Routed experts (an estimate, :meth:`routed_saved_bytes`)."""
        h, v = self.hidden, value_bytes
        norm = tokens * (4 * h + 4 + 2 * v * h)
        rotary = 2 * v * self.head_dim * self.seq_len  # cos and sin, once per position
        qk = tokens * v * (self.q_dim + self.kv_dim) if self.qk_norm else 0
        attention = norm + tokens * (2 * v * self.q_dim + 2 * v * self.kv_dim + 4 * self.heads) + rotary + qk
        mlp = norm + (self.routed_saved_bytes(tokens, v) if self.experts else tokens * 4 * v * self.intermediate)
        saved = self._per_layer(attention, mlp, split_blocks)
        saved[0] += tokens * 8
        saved[-1] += tokens * (4 * h + 4 + 2 * v * h + 4 * self.vocab + 8)
        return saved

    def layer_transient_bytes(self, split_blocks: bool, tokens: int, value_bytes: int) -> list[int]:
        """What each pipeline layer's backward allocates beyond what it keeps, at its peak (an estimate): a block's
        MLP and attention gradients, about ``2 (intermediate + hidden)`` values per token; the last layer the
        loss's gradients of the log-probabilities and of the logits, ``8 x vocab`` bytes per token."""
        v = value_bytes
        block = tokens * 2 * v * (self.active_intermediate + self.hidden)
        transient = [block] * (self.layers * (2 if split_blocks else 1))
        transient[-1] = max(transient[-1], tokens * 8 * self.vocab)
        return transient

    def routed_saved_bytes(self, tokens: float, value_bytes: int) -> float:
        """What a routed MLP keeps for its backward over ``tokens`` (an estimate): the router's probabilities
        (fp32), and per routed copy of a token its gathered input and its expert's output before the weighting
        (``hidden`` values each) and the expert's three intermediate-wide tensors and the product (four, as a dense
        SwiGLU); a shared expert four of its width."""
        v, h = value_bytes, self.hidden
        routed = self.experts_per_token * (4 * v * self.expert_width + 2 * v * h)
        return tokens * (4 * self.experts + routed + 4 * v * self.shared_intermediate)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    def _per_layer(self, attention: int, mlp: int, split_blocks: bool) -> list[int]:
        """A block's attention and MLP amounts as pipeline layers: one per block, or (``split_blocks``) two."""
        return [n for _ in range(self.layers) for n in ((attention, mlp) if split_blocks else (attention + mlp,))]

    def pipeline_layers(self, split_blocks: bool) -> list[int]:
        """Forward FLOPs per token of each pipeline layer: one per block (``split_blocks``: attention and MLP
        apart). The embedding (a lookup, no FLOPs) goes with the first layer, the head with the last."""
        flops = self._per_layer(self.attention_flops(), self.mlp_flops(), split_blocks)
        flops[-1] += self.head_flops()
        return flops

    def layer_costs(self, split_blocks: bool, tokens: int, value_bytes: int, param_bytes: int,
                    backward_ratio: float) -> list[LayerCost]:
        """Each pipeline layer as ``plan.balanced`` weighs it, for the balanced split and the memory table alike
        (what the engine counts with ``FlopCounterMode`` on the built-in Llama; a test compares the FLOPs): FLOPs
        over ``tokens``, parameter bytes (and those in hidden matrices), the bytes its forward keeps
        (:meth:`layer_saved_bytes`), its input and output (one activation, ``tokens x hidden`` values, each: held
        by a stage that starts or ends at it) and its backward's transient (:meth:`layer_transient_bytes`)."""
        boundary = tokens * self.hidden * value_bytes
        return [LayerCost(round(f * tokens), round(f * tokens * backward_ratio), n * param_bytes, saved,
                          input_bytes=boundary, output_bytes=boundary, transient_bytes=transient,
                          matrix_param_bytes=matrices * param_bytes)
                for f, n, saved, transient, matrices in zip(
                    self.pipeline_layers(split_blocks), self.layer_parameters(split_blocks),
                    self.layer_saved_bytes(split_blocks, tokens, value_bytes),
                    self.layer_transient_bytes(split_blocks, tokens, value_bytes),
                    self.layer_matrix_parameters(split_blocks))]


#: ``smollm-360m``: the paper's 360M model (SmolLM-360M). ``llama-10b``: a Llama-style 10B shape (Llama-2-13B's
#: width with 32 blocks, multi-head attention; 10.3B parameters with the tied embedding). ``smollm-135m``:
#: SmolLM-135M. ``llama-3-8b``: Llama-3-8B (vocabulary 128256, embedding and head apart, sequence 8192).
#: ``llama-3-70b``: Llama-3-70B's shape (80 blocks, hidden 8192, 64 heads, 8 key/value heads), sequence 8192.
#: ``qwen3-30b-a3b``: Qwen3-30B-A3B's shape (48 blocks, hidden 2048, 32 query heads of 128 and 4 key/value heads,
#: query and key norms; every MLP 128 experts 768 wide, 8 per token; vocabulary 151936, embedding and head apart;
#: 30.5 B parameters, 29.0 B in experts), sequence 4096.
MODELS: dict[str, Shape] = {
    "smollm-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152, seq_len=2048),
    "llama-3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                        seq_len=8192, tied=False),
    "smollm-360m": Shape(hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560, vocab=49152, seq_len=2048),
    "llama-10b": Shape(hidden=5120, layers=32, heads=40, kv_heads=40, intermediate=13824, vocab=32000, seq_len=2048),
    "llama-3-70b": Shape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256,
                         seq_len=8192, tied=False),
    "qwen3-30b-a3b": Shape(hidden=2048, layers=48, heads=32, kv_heads=4, intermediate=768, vocab=151936,
                           seq_len=4096, tied=False, experts=128, experts_per_token=8, head_size=128, qk_norm=True),
}

#: The command-line flags that override a preset's fields (``--kv-heads`` -> ``kv_heads``), in :class:`Shape`'s
#: order; the routed-expert ones and ``--head-dim`` default to the preset's (or a dense MLP, ``hidden / heads``).
SHAPE_FLAGS = {"hidden": "hidden", "layers": "layers", "heads": "heads", "kv_heads": "kv_heads",
               "intermediate": "intermediate", "vocab": "vocab", "seq_len": "seq_len", "experts": "experts",
               "experts_per_token": "experts_per_token", "expert_intermediate": "expert_intermediate",
               "shared_intermediate": "shared_intermediate", "head_dim": "head_size"}
REQUIRED = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "seq_len")


def shape_from_args(args: argparse.Namespace) -> Optional[Shape]:
    """The shape ``--model`` names with the given flags overriding its fields, or one from the flags alone;
    ``None`` where a required size is missing (the caller names them, :func:`missing_sizes`)."""
    given = {field: getattr(args, flag, None) for flag, field in SHAPE_FLAGS.items()}
    given = {k: v for k, v in given.items() if v is not None}
    base = MODELS.get(args.model) if getattr(args, "model", None) else None
    if base is not None:
        return replace(base, **given)
    if missing_sizes(args):
        return None
    return Shape(**given)


def missing_sizes(args: argparse.Namespace) -> list[str]:
    """The flags a shape without ``--model`` lacks."""
    if getattr(args, "model", None):
        return []
    return [f"--{k.replace('_', '-')}" for k in REQUIRED if getattr(args, k, None) is None]
