"""A small nanoGPT-style decoder, written as a ``PipelineModule``.

The model is a flat list of layers (embedding, transformer blocks, head) so that a pipeline strategy can cut it
anywhere. Nothing is shared between layers: the input embedding and the output projection are separate matrices
(no weight tying), because they usually live on different pipeline stages. With tensor parallelism
(``configure_model`` finds a ``"tensor_parallel"`` mesh dimension of size > 1) ``GPT.parallelize`` applies its
plan (docs/design/tensor-parallel.md, "Models with a plan").
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from lightning_async_pp.models import packing
from lightning_async_pp.module import PipelineModule
from lightning_async_pp.optim.groups import decay_matrices_only
from lightning_async_pp.parallel.mesh import tensor_parallel_mesh
from lightning_async_pp.parallel.tensor_parallel import layout_hooks_on_entries


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head})")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.out_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """``position_ids`` (B, T) restarting at each document: each token attends within its document only."""
        B, T, C = x.shape
        w, b = self.qkv.weight, self.qkv.bias
        if isinstance(w, DTensor):
            # Tensor parallelism (GPT.parallelize): this rank's rows of the fused matrix are its heads' q, k and v
            # rows, one after another; x is whole on every rank, so its gradient from here is a partial sum.
            qkv = F.linear(x.to_local(grad_placements=(Partial(),)), w.to_local(),
                           None if b is None else b.to_local())
        else:
            qkv = self.qkv(x)
        q, k, v = qkv.chunk(3, dim=2)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim); -1 heads: under tensor parallelism n_head / t
        q, k, v = (t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        if position_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        else:  # each document's blocks only; what it needs is built once per microbatch on this stage
            y = packing.document_attention(q, k, v, position_ids, dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.out_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.out_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.out_proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Any) -> Any:
        if isinstance(x, Mapping):  # a packed microbatch: the hidden state with its positions
            h, pos = x[packing.HIDDEN], x[packing.POSITION_IDS]
            h = h + self.attn(self.ln_1(h), position_ids=pos)  # a keyword: the plan's input hook takes h alone
            return {packing.HIDDEN: h + self.mlp(self.ln_2(h)), packing.POSITION_IDS: pos}
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token ids (B, T) -> token + position embeddings (B, T, C)."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.token = nn.Embedding(vocab_size, n_embd)
        self.position = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, idx: Any) -> Any:
        """Token ids (B, T), or a packed microbatch ``{"input_ids", "position_ids"}`` (positions restarting at each
        document), whose positions then travel on with the hidden state."""
        packed = isinstance(idx, Mapping)
        if packed:
            idx, pos = idx[packing.INPUT_IDS], idx[packing.POSITION_IDS]
        T = idx.shape[1]
        if T > self.block_size:
            raise ValueError(f"Sequence of length {T} is longer than block_size {self.block_size}")
        if not packed:
            return self.dropout(self.token(idx) + self.position(torch.arange(T, device=idx.device)))
        return {packing.HIDDEN: self.dropout(self.token(idx) + self.position(pos)), packing.POSITION_IDS: pos}


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits (B, T, vocab_size)."""

    def __init__(self, n_embd: int, vocab_size: int, bias: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, x: Any) -> Tensor:
        if isinstance(x, Mapping):
            x = x[packing.HIDDEN]
        return self.proj(self.norm(x))


class GPT(PipelineModule):
    """Byte-level GPT. A batch is a LongTensor (B, block_size + 1) of token ids; inputs are all but the last
    token, targets all but the first. A batch may also be packed, ``{"input_ids": (B, T + 1), "position_ids":
    (B, T + 1)}`` (``data.TextDataModule(document_mask=True)``): positions restart at each document and each token
    attends only to the earlier tokens of its document (``models/packing.py``); ``skip_document_ends`` then leaves
    each document's last target (the next document's first token) out of the loss."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        skip_document_ends: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embedding = Embedding(vocab_size, block_size, n_embd, dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.head = Head(n_embd, vocab_size, bias)
        self._tensor_parallel_size = 1  # parallelize() sets it
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layer), so that the
        # residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("out_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # ---- tensor parallelism ------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        tp_mesh = tensor_parallel_mesh(self.device_mesh)  # set by a strategy with tensor parallelism
        if self._tensor_parallel_size == 1 and tp_mesh is not None:  # Lightning calls this hook on every entry point
            self.parallelize(tp_mesh)

    def parallelize(self, tp_mesh: Any) -> None:
        """Apply the tensor-parallel plan over ``tp_mesh`` (docs/design/tensor-parallel.md, "Models with a plan"):
        ``models.Llama``'s, with GPT's two differences. The fused ``qkv`` matrix is split column-wise so that each
        rank holds its own heads' q, k and v rows (a strided placement: the matrix keeps its one-device layout, in
        checkpoints and the gather); the embedding adds the learned position embedding (replicated) to the
        token embedding's all-reduced output, then each rank keeps its sequence shard, as Megatron-LM does. The
        norms are sequence-parallel, ``fc`` column-wise, ``out_proj`` row-wise, the head split over the
        vocabulary (its logits never gathered: the loss runs under ``loss_parallel``).

        GPT is built whole in ``__init__``: each rank takes its slices of tensor-parallel rank 0's values (so the
        ranks agree even unseeded), which are one device's."""
        from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                       RowwiseParallel, SequenceParallel, parallelize_module)
        from torch.distributed.tensor.placement_types import _StridedShard

        from lightning_async_pp.parallel.mesh import (check_tensor_parallel_divides, check_tensor_parallel_no_dropout,
                                                      replica_processes)

        h, t = self.hparams, tp_mesh.size()
        check_tensor_parallel_divides(t, {"n_head": h.n_head, "vocab_size": h.vocab_size}, "GPT",
                                      replica_processes(self.device_mesh))
        check_tensor_parallel_no_dropout(t, {"dropout": h.dropout}, "GPT")
        # The whole values, kept aside while the plan lays the parameters out on the meta device (no memory, no
        # communication; under the strategy's configure_model new parameters are registered there anyway).
        whole: dict[tuple[int, str], Tensor] = {}
        for m in self.modules():
            for name, p in m._parameters.items():
                if p is not None and not p.is_meta:
                    whole[(id(m), name)] = p.detach()
                    m._parameters[name] = nn.Parameter(p.detach().to("meta"), p.requires_grad)

        def heads_rows(name: str, module: nn.Module, mesh: Any) -> None:  # rank i: q, k, v rows of its heads
            for n, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(n, nn.Parameter(
                    distribute_tensor(p, mesh, [_StridedShard(0, split_factor=3)]), p.requires_grad))

        def replicated_input(module: nn.Module, inputs: tuple, mesh: Any) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        def local_output(module: nn.Module, output: Any, mesh: Any) -> Any:
            return output.to_local()

        gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        block_plan = {"ln_1": SequenceParallel(), "attn": gather_sequence,
                      "attn.out_proj": RowwiseParallel(output_layouts=Shard(1)),
                      "ln_2": SequenceParallel(), "mlp": gather_sequence,
                      "mlp.fc": ColwiseParallel(), "mlp.out_proj": RowwiseParallel(output_layouts=Shard(1))}
        parallelize_module(self.embedding.token, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        parallelize_module(self.embedding, tp_mesh,
                           PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)))
        layout_hooks_on_entries(self.embedding, None, packing.HIDDEN)  # a packed microbatch's positions stay whole
        distribute_module(self.embedding.position, tp_mesh, input_fn=replicated_input, output_fn=local_output)
        for block in self.blocks:
            parallelize_module(block, tp_mesh, block_plan)
            distribute_module(block.attn.qkv, tp_mesh, partition_fn=heads_rows)
        parallelize_module(self.head, tp_mesh, {
            "norm": SequenceParallel(),
            "proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
        for m in self.modules():
            for name, p in m._parameters.items():
                value = whole.get((id(m), name))
                if value is not None:
                    m._parameters[name] = nn.Parameter(
                        distribute_tensor(value, p.device_mesh, p.placements) if isinstance(p, DTensor) else value,
                        p.requires_grad)
        self._tensor_parallel_size = t

    # ---- the PipelineModule contract -------------------------------------------------------------------------
    def pipeline_layers(self) -> Sequence[nn.Module]:
        return [self.embedding, *self.blocks, self.head]

    def pipeline_input(self, batch: Any) -> Any:
        return packing.model_input(batch, "GPT", self._tensor_parallel_size)

    def pipeline_sample(self) -> Any:
        """The example batch if one is set, else one row of ``block_size`` tokens (and its target)."""
        sample = super().pipeline_sample()
        return sample if sample is not None else packing.token_row(self.embedding.block_size)

    def pipeline_loss(self, logits: Tensor, batch: Any) -> Tensor:
        if isinstance(batch, Tensor):
            return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        return packing.document_loss(logits, batch, self.hparams.skip_document_ends)

    def pipeline_loss_weight(self, batch: Any) -> Any:
        return packing.loss_weight(batch, self.hparams.skip_document_ends, "GPT")  # kept targets, where skipped

    # ---- optimizer ---------------------------------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = decay_matrices_only(self.named_parameters(), self.hparams.weight_decay)
        return torch.optim.AdamW(groups, lr=self.hparams.learning_rate, betas=(0.9, 0.95))
