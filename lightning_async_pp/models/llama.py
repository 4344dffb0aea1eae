"""A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU), as a ``PipelineModule``.

The model is a flat list of layers (token embedding, decoder blocks, head = final norm + output projection) so
that a pipeline strategy can cut it anywhere; what crosses a cut is the hidden state (B, T, C). Presets follow
SmolLM's shapes. As in SmolLM, the output projection reuses the embedding matrix by default
(``tie_embeddings=True``): ``head.proj.weight`` *is* ``embed.weight``, one Parameter that both ends train.

Layers are built in ``__init__`` with their parameters on the meta device (so callbacks' ``setup``, which Lightning
runs before ``configure_model``, finds them: a fine-tuning callback can freeze ``embed``), and ``configure_model()``
gives them memory where the context creates parameters, so Lightning (or a pipeline strategy) decides where and when
they are materialized (``models/meta_built.py``). Rotary tables are computed on the fly, so there is no buffer to
save, move or re-initialize.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_async_pp.models import packing
from lightning_async_pp.models.meta_built import BuiltInInit
from lightning_async_pp.models.moe import add_statistics, balancing_loss
from lightning_async_pp.models.routed_experts import RoutedExperts, init_experts, take_statistics, with_statistics
from lightning_async_pp.module import PipelineModule, layer_seed
from lightning_async_pp.optim.groups import decay_matrices_only
from lightning_async_pp.parallel.expert import expert_parallel_mesh
from lightning_async_pp.parallel.mesh import tensor_parallel_mesh
from lightning_async_pp.parallel.tensor_parallel import layout_hooks_on_entries


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture's shape. ``Llama`` builds one from a preset plus keyword overrides and checks it here."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 172
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    num_experts: int = 0  # > 0: every block's MLP is that many routed experts (models/routed_experts.py)
    experts_per_token: int = 2
    expert_intermediate_size: Optional[int] = None  # each expert's width; default intermediate_size
    router_aux_loss_coef: float = 0.01  # the load-balancing loss's weight (0: none)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"the head dimension ({self.head_dim}) must be even for rotary embeddings")
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.experts_per_token <= self.num_experts):
            raise ValueError(f"num_experts must be >= 0 (0: dense MLPs) and experts_per_token between 1 and "
                             f"num_experts, got num_experts={self.num_experts}, experts_per_token={self.experts_per_token}")
        if self.expert_intermediate_size is not None and self.expert_intermediate_size < 1:
            raise ValueError(f"expert_intermediate_size must be positive, got {self.expert_intermediate_size}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


#: Architecture presets (vocabulary size comes from the data, not from here). SmolLM shapes from its Hugging Face
#: configs; ``tiny`` trains on a CPU in seconds.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=172),
    "smollm-135m": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536),
    "smollm-360m": dict(hidden_size=960, num_layers=32, num_heads=15, num_kv_heads=5, intermediate_size=2560),
}


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin tables (seq_len, head_dim) in float32, halves repeated (the Hugging Face Llama layout)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotary_cos_sin_at(position_ids: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin (B, 1, T, head_dim) at the given positions (B, T): the rows of :func:`rotary_cos_sin`'s tables
    (the same float32 products), for positions that restart at each document."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, heads, T, head_dim) by position: pairs are (i, i + head_dim / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions; ``num_kv_heads`` key/value heads are shared by
    groups of ``num_heads // num_kv_heads`` query heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.max_seq_len, self.rope_theta = cfg.max_seq_len, cfg.rope_theta
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
        """``position_ids`` (B, T): positions restarting at each document, which then attends only within itself
        (``models/packing.py``); ``None``: one sequence, positions ``0..T-1``."""
        B, T, _ = x.shape
        if T > self.max_seq_len:
            raise ValueError(f"Sequence of length {T} is longer than max_seq_len {self.max_seq_len}")
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim); -1 heads: under tensor parallelism (column-wise
        # q, k, v) this rank holds heads / t query and kv_heads / t key/value heads
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        gqa = q.size(1) != k.size(1)
        if position_ids is None:
            cos, sin = rotary_cos_sin(T, self.head_dim, self.rope_theta, x.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            cos, sin = rotary_cos_sin_at(position_ids, self.head_dim, self.rope_theta)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            # Each document's blocks only; what it needs is built once per microbatch on this stage.
            y = packing.document_attention(q, k, v, position_ids, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-RMSNorm decoder block: x + attn(norm(x)), then + mlp(norm(x)). With ``num_experts`` the MLP is routed
    experts, and the router statistics of the balancing loss ride beside the hidden state: ``(x, statistics)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp: nn.Module = SwiGLU(cfg) if not cfg.num_experts else RoutedExperts(
            cfg.hidden_size, cfg.expert_intermediate_size or cfg.intermediate_size, cfg.num_experts,
            cfg.experts_per_token, statistics=cfg.router_aux_loss_coef > 0)

    def _mlp(self, x: Tensor, carried: Optional[dict[str, Tensor]]) -> tuple[Tensor, Optional[dict[str, Tensor]]]:
        out = self.mlp(x)
        return (out[0], add_statistics(carried, out[1])) if isinstance(out, tuple) else (out, carried)

    def forward(self, x: Any) -> Any:
        x, carried = take_statistics(x)
        if isinstance(x, Mapping):  # a packed microbatch: the hidden state with its positions
            h, pos = x[packing.HIDDEN], x[packing.POSITION_IDS]
            h = h + self.attn(self.attn_norm(h), position_ids=pos)  # a keyword: the plan's input hook takes h alone
            m, carried = self._mlp(self.mlp_norm(h), carried)
            return with_statistics({packing.HIDDEN: h + m, packing.POSITION_IDS: pos}, carried)
        x = x + self.attn(self.attn_norm(x))
        m, carried = self._mlp(self.mlp_norm(x), carried)
        return with_statistics(x + m, carried)


class TokenEmbedding(nn.Embedding):
    """The token embedding; given a packed microbatch ``{"input_ids", "position_ids"}`` it passes the positions on
    with the hidden state (``models/packing.py``)."""

    def forward(self, x: Any) -> Any:
        if isinstance(x, Mapping):
            return {packing.HIDDEN: super().forward(x[packing.INPUT_IDS]), packing.POSITION_IDS: x[packing.POSITION_IDS]}
        return super().forward(x)


class Head(nn.Module):
    """Final RMSNorm and the projection to vocabulary logits (B, T, vocab_size)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.proj = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: Any) -> Any:
        x, statistics = take_statistics(x)  # routed experts' statistics go on to the loss
        if isinstance(x, Mapping):
            x = x[packing.HIDDEN]
        return with_statistics(self.proj(self.norm(x)), statistics)


class Llama(BuiltInInit, PipelineModule):
    """Llama-style language model. A batch is a LongTensor (B, T + 1) of token ids; inputs are all but the last
    token, targets all but the first (the same convention as :class:`~lightning_async_pp.models.GPT`).

    Args:
        size: a preset of :data:`PRESETS` (``tiny``, ``smollm-135m``, ``smollm-360m``); the keyword arguments
            ``hidden_size`` ... ``intermediate_size`` override its values.
        vocab_size: vocabulary size (256 for the byte-level data of this package; 49152 for SmolLM's tokenizer).
        tie_embeddings: the output projection is the embedding matrix (one Parameter), as in SmolLM.
        max_seq_len: longest sequence accepted (rotary tables are computed for the actual length).
        init_seed: seed of the initialization; ``None`` uses ``torch.initial_seed()`` (what ``torch.manual_seed``
            or ``seed_everything`` set). Each pipeline layer draws from its own generator seeded by this seed and
            the layer's index, so a layer's weights do not depend on which other layers are built, nor on the
            device.
        skip_document_ends: with packed batches (``{"input_ids", "position_ids"}``, ``data.TextDataModule(
            document_mask=True)``), the loss skips each document's last target: the next document's first token.
        num_experts: ``> 0`` makes every block's MLP a mixture of that many SwiGLU experts (Mixtral's and
            Qwen3-MoE's block: a router, dropless top-``experts_per_token`` routing over softmax probabilities,
            renormalized), each ``expert_intermediate_size`` wide (default ``intermediate_size``); the loss adds
            ``router_aux_loss_coef`` times transformers' load-balancing loss per microbatch (0: none), logged as
            ``train_aux_loss``. Under ``AsyncPipelineStrategy(expert_parallel_size=e)`` each rank of an expert
            group holds ``num_experts / e`` of them (docs/design/expert-parallel.md).

    A batch may also be packed, ``{"input_ids": (B, T + 1), "position_ids": (B, T + 1)}``: positions restart at
    each document, and each token attends only to the earlier tokens of its own document (``models/packing.py``).
    """

    def __init__(
        self,
        size: str = "tiny",
        vocab_size: int = 256,
        tie_embeddings: bool = True,
        *,
        hidden_size: Optional[int] = None,
        num_layers: Optional[int] = None,
        num_heads: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        intermediate_size: Optional[int] = None,
        max_seq_len: int = 2048,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-5,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        init_seed: Optional[int] = None,
        skip_document_ends: bool = False,
        num_experts: int = 0,
        experts_per_token: int = 2,
        expert_intermediate_size: Optional[int] = None,
        router_aux_loss_coef: float = 0.01,
    ) -> None:
        super().__init__()
        if size not in PRESETS:
            raise ValueError(f"Unknown Llama size {size!r}; valid presets: {', '.join(PRESETS)}")
        self.save_hyperparameters()
        overrides = dict(
            hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            intermediate_size=intermediate_size,
        )
        shape = {**PRESETS[size], **{k: v for k, v in overrides.items() if v is not None}}
        self.config = LlamaConfig(
            vocab_size=vocab_size, max_seq_len=max_seq_len, rope_theta=rope_theta, norm_eps=norm_eps,
            tie_embeddings=tie_embeddings, num_experts=num_experts, experts_per_token=experts_per_token,
            expert_intermediate_size=expert_intermediate_size, router_aux_loss_coef=router_aux_loss_coef, **shape,
        )
        self._aux_logged: list[Tensor] = []  # the balancing loss of each training microbatch, for the logger
        self._configured = False
        self._tensor_parallel_size = 1  # parallelize() sets it
        self._build_on_meta(self._build_layers)  # parameters on the meta device until configure_model()

    # ---- building ----------------------------------------------------------------------------------------------
    def _build_layers(self) -> None:
        cfg = self.config
        self.embed = TokenEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        if cfg.tie_embeddings:
            self.head.proj.weight = self.embed.weight

    def _is_configured(self) -> bool:
        return self._configured

    def configure_model(self) -> None:
        if self._configured:  # Lightning calls this hook on every trainer entry point
            return
        self._materialize()  # what layers built here would get; keeps requires_grad (a layer frozen in setup)
        self._configured = True
        self.init_weights()
        tp_mesh = tensor_parallel_mesh(self.device_mesh)  # set by a strategy with tensor parallelism
        if tp_mesh is not None:
            self.parallelize(tp_mesh)
        ep_mesh = expert_parallel_mesh(self.device_mesh)  # set by a strategy with expert parallelism
        if ep_mesh is not None and self.config.num_experts:
            for block in self.blocks:  # before init_weights gives them memory: each rank keeps E / e experts
                block.mlp.experts.shard(ep_mesh, "Llama")

    def parallelize(self, tp_mesh: Any) -> None:
        """Apply the tensor-parallel plan over ``tp_mesh`` (docs/design/tensor-parallel.md, "Tensor parallelism"),
        torchtitan's Llama plan: the embedding split over the vocabulary, its output reduce-scattered over the
        sequence; in each block the norms sequence-parallel, attention and MLP each behind an all-gather of the
        sequence, q, k, v, gate and up column-wise, o and down row-wise with their output reduce-scattered back to
        sequence shards; the final norm sequence-parallel and the head column-wise over the vocabulary, its logits
        never gathered (the loss runs under ``loss_parallel``). What crosses a stage boundary is each rank's
        ``[batch, seq / t, hidden]`` shard. A tied head keeps the embedding's matrix: both split it by rows."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel, parallelize_module)

        from lightning_async_pp.parallel.mesh import check_tensor_parallel_divides, replica_processes

        cfg = self.config
        if cfg.num_experts:
            raise ValueError(f"tensor parallelism of routed experts is not supported yet (num_experts="
                             f"{cfg.num_experts}, tensor_parallel_size={tp_mesh.size()}); use tensor_parallel_size=1")
        check_tensor_parallel_divides(tp_mesh.size(), {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                                                       "intermediate_size": cfg.intermediate_size,
                                                       "vocab_size": cfg.vocab_size}, "Llama",
                                      replica_processes(self.device_mesh))
        gather_sequence = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan = {"attn_norm": SequenceParallel(), "attn": gather_sequence,
                "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
                "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp_norm": SequenceParallel(), "mlp": gather_sequence,
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))}
        parallelize_module(self.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        # a packed microbatch: its ids in, its hidden state's sequence shard out, the positions whole beside them
        layout_hooks_on_entries(self.embed, packing.INPUT_IDS, packing.HIDDEN)
        for block in self.blocks:
            parallelize_module(block, tp_mesh, plan)
        parallelize_module(self.head, tp_mesh, {
            "norm": SequenceParallel(),
            "proj": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)})
        if cfg.tie_embeddings:  # each module got its own DTensor of the one matrix, split alike (rows): one again
            self.head.proj.weight = self.embed.weight
        self._tensor_parallel_size = tp_mesh.size()

    def init_weights(self) -> None:
        """(Re-)initialize every layer that is materialized (layers on the ``meta`` device are skipped)."""
        for index, layer in enumerate(self.pipeline_layers()):
            self.init_layer(index, layer)

    @torch.no_grad()
    def init_layer(self, index: int, layer: nn.Module) -> None:
        """Initialize pipeline layer ``index``: normal(0, 0.02) matrices, norm gains 1, and (GPT-2 style)
        std 0.02 / sqrt(2 * num_layers) for the projections that write into the residual stream, so that its
        variance does not grow with depth. A tied head's matrix belongs to the embedding (layer 0)."""
        generator = torch.Generator().manual_seed(layer_seed(index, self.hparams.init_seed))
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        # each expert from a generator of its own: its weights whatever experts this process holds
        experts = init_experts(layer, layer_seed(index, self.hparams.init_seed), 0.02, residual_std)
        for name, p in layer.named_parameters():
            if p.is_meta or id(p) in experts or (layer is self.head and self.config.tie_embeddings
                                                 and name == "proj.weight"):
                continue
            if p.dim() == 1:  # RMSNorm gain
                p.fill_(1.0)
                continue
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            # Drawn on the CPU, then copied: the same weights whatever the device (a tensor-parallel shard takes
            # its slice of the whole matrix one device draws).
            full = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            if isinstance(p, DTensor):
                full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)

    # ---- the PipelineModule contract -------------------------------------------------------------------------
    def pipeline_layers(self) -> Sequence[nn.Module]:
        if not self._configured:
            raise RuntimeError("Llama's layers get memory in configure_model(); call it (or let the Trainer) first")
        return [self.embed, *self.blocks, self.head]

    def pipeline_input(self, batch: Any) -> Any:
        return packing.model_input(batch, "Llama", self._tensor_parallel_size)

    def pipeline_sample(self) -> Any:
        """The example batch if one is set, else one row of ``min(max_seq_len, 256)`` tokens (and its target)."""
        sample = super().pipeline_sample()
        return sample if sample is not None else packing.token_row(min(self.config.max_seq_len, 256))

    def pipeline_loss(self, output: Any, batch: Any) -> Tensor:
        logits, statistics = take_statistics(output)
        if isinstance(batch, Tensor):
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        else:
            loss = packing.document_loss(logits, batch, self.hparams.skip_document_ends)
        if statistics is None:
            return loss
        aux = balancing_loss(statistics)  # transformers' load_balancing_loss_func over this microbatch's tokens
        if torch.is_grad_enabled():
            self._aux_logged.append(aux.detach())
        return loss + self.config.router_aux_loss_coef * aux

    def pipeline_metric_names(self) -> tuple[str, ...]:
        return ("train_aux_loss",) if self.config.num_experts and self.config.router_aux_loss_coef > 0 else ()

    def pipeline_metrics(self) -> dict[str, Tensor]:
        if not self.pipeline_metric_names():
            return {}
        logged, self._aux_logged = self._aux_logged, []
        if not logged:
            raise RuntimeError("pipeline_metrics() was called before any training pipeline_loss() of the batch")
        return {"train_aux_loss": torch.stack(logged).mean()}

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        output = super().predict_step(batch, batch_idx, dataloader_idx)
        return output if output is None else take_statistics(output)[0]

    def pipeline_loss_weight(self, batch: Any) -> Any:
        return packing.loss_weight(batch, self.hparams.skip_document_ends, "Llama")  # kept targets, where skipped

    # ---- optimizer ---------------------------------------------------------------------------------------------
    def configure_optimizers(self) -> torch.optim.Optimizer:
        # As GPT: weight decay on matrices (linear weights, the embedding) only, not on norm gains. A tied matrix
        # is listed once by named_parameters(), under its first name (embed.weight), so it is updated once.
        groups = decay_matrices_only(self.named_parameters(), self.hparams.weight_decay)
        return torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
