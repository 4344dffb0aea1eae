"""Model shapes for the planner: a Llama-style decoder's FLOPs, parameters and activation bytes per pipeline
layer (:class:`Shape`), and the named shapes ``--model`` picks from (:data:`MODELS`)."""
from __future__ import annotations

from dataclasses import dataclass

from lightning_async_pp.plan.balanced import LayerCost


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder (RMSNorm, grouped-query attention, SwiGLU MLP, tied embedding and head, or, with
    ``tied=False``, an embedding and a head of their own: the stages hold the same bytes either way)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    seq_len: int
    tied: bool = True

    @property
    def kv_dim(self) -> int:
        return self.hidden * self.kv_heads // self.heads

    def attention_flops(self) -> int:
        """Forward FLOPs per token of one block's attention: the q, k, v, o projections (2 FLOPs per weight) and
        the scores and weighted values, 4 * seq_len * hidden (causal masking not discounted)."""
        h = self.hidden
        return 2 * (2 * h * h + 2 * h * self.kv_dim) + 4 * self.seq_len * h

    def mlp_flops(self) -> int:
        """Forward FLOPs per token of one block's SwiGLU MLP: three hidden x intermediate matrices."""
        return 2 * 3 * self.hidden * self.intermediate

    def head_flops(self) -> int:
        """Forward FLOPs per token of the output projection (the loss's softmax is negligible)."""
        return 2 * self.hidden * self.vocab

    def parameters(self) -> int:
        h = self.hidden
        block = 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate + 2 * h
        return self.layers * block + self.vocab * h * (1 if self.tied else 2) + h

    def layer_parameters(self, split_blocks: bool) -> list[int]:
        """Parameters of each pipeline layer, as :meth:`pipeline_layers` splits them. The tied embedding/head is
        held (and its gradient reduced) by the first and by the last layer's stage; the final norm goes last."""
        h = self.hidden
        attention, mlp = 2 * h * h + 2 * h * self.kv_dim + h, 3 * h * self.intermediate + h
        params = self._per_layer(attention, mlp, split_blocks)
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
        h = self.hidden
        attention, mlp = 2 * h * h + 2 * h * self.kv_dim, 3 * h * self.intermediate
        return self._per_layer(attention, mlp, split_blocks)

    def layer_saved_bytes(self, split_blocks: bool, tokens: int, value_bytes: int) -> list[int]:
        """Bytes each pipeline layer keeps for its backward over a microbatch of ``tokens`` (whole sequences), as
        transformers' Llama layers do under SDPA's causal kernel (``HuggingFaceCausalLM``; a test counts them):
        an RMSNorm its input in fp32, the reciprocal RMS (fp32) and two tensors of ``value_bytes``; attention the
        rotated queries and its output, the rotated keys and the values, a log-sum-exp per head (fp32) and the
        rotary cos and sin once per position; the SwiGLU MLP four intermediate-wide tensors; the embedding the
        token ids; the last layer the final norm, the head's input and the loss's log-probabilities (fp32)."""
        h, v = self.hidden, value_bytes
        norm = tokens * (4 * h + 4 + 2 * v * h)
        rotary = 2 * v * self.head_dim * self.seq_len  # cos and sin, once per position
        attention = norm + tokens * (2 * v * h + 2 * v * self.kv_dim + 4 * self.heads) + rotary
        mlp = norm + tokens * 4 * v * self.intermediate
        saved = self._per_layer(attention, mlp, split_blocks)
        saved[0] += tokens * 8
        saved[-1] += tokens * (4 * h + 4 + 2 * v * h + 4 * self.vocab + 8)
        return saved

    def layer_transient_bytes(self, split_blocks: bool, tokens: int, value_bytes: int) -> list[int]:
        """What each pipeline layer's backward allocates beyond what it keeps, at its peak (an estimate): a block's
        MLP and attention gradients, about ``2 (intermediate + hidden)`` values per token; the last layer the
        loss's gradients of the log-probabilities and of the logits, ``8 x vocab`` bytes per token."""
        v = value_bytes
        block = tokens * 2 * v * (self.intermediate + self.hidden)
        transient = [block] * (self.layers * (2 if split_blocks else 1))
        transient[-1] = max(transient[-1], tokens * 8 * self.vocab)
        return transient

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

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
MODELS: dict[str, Shape] = {
    "smollm-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, vocab=49152, seq_len=2048),
    "llama-3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                        seq_len=8192, tied=False),
    "smollm-360m": Shape(hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560, vocab=49152, seq_len=2048),
    "llama-10b": Shape(hidden=5120, layers=32, heads=40, kv_heads=40, intermediate=13824, vocab=32000, seq_len=2048),
    "llama-3-70b": Shape(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256,
                         seq_len=8192, tied=False),
}
