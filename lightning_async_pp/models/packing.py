"""Packed rows with document masks: positions that restart at each document, attention within each document, and
the targets a loss may skip (see docs/design/data.md, 'Packed documents').

A packed batch is a mapping ``{"input_ids": (B, T + 1), "position_ids": (B, T + 1)}`` (what
``data.TextDataModule(document_mask=True)`` yields): positions count from 0 at the start of each document, so a
document starts where a position is not its predecessor's plus one (transformers' convention for packed sequences).
Between pipeline layers the hidden state travels with its positions, as ``{"hidden": (B, T, C), "position_ids":
(B, T)}``; each stage finds the documents once per microbatch in the positions it received (:class:`Documents`,
kept for the positions tensor, which every layer of the stage is handed, while it holds those positions), and
:func:`document_attention` computes only each document's blocks, so no (T, T) mask crosses a stage or, on the
fast path, is made at all.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

#: The keys of a packed batch.
INPUT_IDS, POSITION_IDS = "input_ids", "position_ids"
#: The key of the hidden state between layers (beside :data:`POSITION_IDS`).
HIDDEN = "hidden"
#: Targets a loss ignores (``F.cross_entropy``'s default ``ignore_index``).
IGNORE = -100


def is_packed(batch: Any) -> bool:
    """Whether ``batch`` is a packed batch (a mapping with ``input_ids`` and ``position_ids``)."""
    return isinstance(batch, Mapping) and INPUT_IDS in batch and POSITION_IDS in batch


#: The dtypes ``position_ids`` may have: a narrower one wraps (uint8 at 256) and would invent document starts.
POSITION_DTYPES = (torch.int64, torch.int32)


def check_packed(batch: Any, who: str) -> Mapping[str, Tensor]:
    """``batch`` if it is a packed batch of equal-shaped 2-D integer tensors (positions int64 or int32), else a
    clear error naming ``who``."""
    if isinstance(batch, Mapping) and set(batch) == {INPUT_IDS}:
        raise TypeError(f"{who}: a dict batch is a packed batch and needs {POSITION_IDS!r} beside {INPUT_IDS!r} "
                        f"(data.TextDataModule(document_mask=True) makes both); got keys {sorted(batch)}. Without "
                        f"documents, pass the token ids alone: a tensor (B, T + 1)")
    if not isinstance(batch, Mapping) or not is_packed(batch):
        keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise TypeError(f"{who} takes a token tensor (B, T + 1) or a packed batch {{'input_ids', 'position_ids'}} "
                        f"(data.TextDataModule(document_mask=True)); got {keys}")
    extra = sorted(set(batch) - {INPUT_IDS, POSITION_IDS})
    if extra:
        raise TypeError(f"{who}: a packed batch holds input_ids and position_ids only; got also {extra} (padding "
                        f"masks and labels are not taken: pack the text into full rows, data.TextDataModule)")
    ids, pos = batch[INPUT_IDS], batch[POSITION_IDS]
    if (ids.dim() != 2 or ids.shape != pos.shape or ids.is_floating_point() or pos.is_floating_point()
            or torch.bool in (ids.dtype, pos.dtype)):
        raise ValueError(f"{who}: input_ids and position_ids must be integer tensors of one shape (B, T + 1); got "
                         f"{ids.dtype} {tuple(ids.shape)} and {pos.dtype} {tuple(pos.shape)}")
    if pos.dtype not in POSITION_DTYPES:
        accepted = " or ".join(map(str, POSITION_DTYPES))
        raise ValueError(f"{who}: position_ids of dtype {pos.dtype} would wrap past its largest value (a later token "
                         f"read as position 0, a document start); give them as {accepted}")
    return batch


def packed_positions(ids: Tensor, eos: int) -> Tensor:
    """Positions (same shape as ``ids``, int64) counting from 0 at the start of each row and after each ``eos``
    token: the ``eos`` ends its document, the token after it starts the next."""
    length = ids.shape[-1]
    index = torch.arange(length, device=ids.device).expand_as(ids)
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = ids[..., :-1] == eos
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - last_start


def document_ids(position_ids: Tensor) -> Tensor:
    """(B, T) -> (B, T): which document of its row each token belongs to (0, 1, ...); a document starts at the
    first token and wherever a position is not the previous one plus one."""
    starts = torch.ones_like(position_ids, dtype=torch.long)
    starts[..., 1:] = (position_ids[..., 1:] != position_ids[..., :-1] + 1).long()
    return starts.cumsum(dim=-1) - 1


_cached: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def per_positions(position_ids: Tensor, key: Any, build: Any) -> Any:
    """``build()``, once per microbatch's positions and ``key`` (what else the value depends on): what every layer of
    a stage needs from a microbatch's positions (the document mask, an upstream model's rotary tables).

    Kept while the positions tensor lives and used again only while its version is the one it had: every write
    bumps it, the receive into a pooled buffer included (``pipeline/comm.py``, ``StageLink._take_buffers``, where an
    earlier microbatch's tensor is refilled outside autograd), so no content is compared (on CUDA a host wait per
    layer). An inference tensor keeps no version; none is refilled (evaluation receives into new buffers)."""
    version = -1 if position_ids.is_inference() else position_ids._version
    entry = _cached.get(position_ids)
    if entry is None or entry[0] != version:
        entry = _cached[position_ids] = (version, {})
    values = entry[1]
    if key not in values:
        values[key] = build()
    return values[key]


def document_causal_mask(position_ids: Tensor) -> Tensor:
    """The block-diagonal causal mask (B, 1, T, T), ``True`` where query ``i`` may attend to key ``j``: ``j <= i``
    in the same document. Built once per microbatch's positions on a stage (every layer of the stage is handed
    them; :func:`per_positions`), recomputation under activation checkpointing included."""
    return per_positions(position_ids, "document_causal_mask", lambda: _document_causal_mask(position_ids))


def _document_causal_mask(position_ids: Tensor) -> Tensor:
    docs = document_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((docs.unsqueeze(-1) == docs.unsqueeze(-2)) & causal).unsqueeze(1)


#: The per-document path's cost of one attention call (forward and backward), in units of one query-key pair of a
#: masked attention: measured on CPU (SmolLM-135M's heads, one thread) as about 2000 pairs; where a microbatch's
#: documents are so many and short that their calls cost more than the masked (T, T) attention, the mask is used.
CALL_COST_PAIRS = 2000


class Documents:
    """The document structure of one microbatch's positions (B, T), built once per microbatch on a stage
    (:func:`documents`) and handed to every attention of its layers.

    On CPU it holds each row's documents as ``(start, end)`` spans and whether attention goes document by document
    (SDPA's causal kernel on each, computing only each document's blocks) or through the block-diagonal mask (where
    its one call is cheaper than the documents' many: :data:`CALL_COST_PAIRS`). On CUDA it holds a ``flex_attention``
    block mask, which skips the masked blocks without reading the positions back to the host."""

    def __init__(self, position_ids: Tensor) -> None:
        self.shape = tuple(position_ids.shape)
        self.device = position_ids.device
        self._position_ids = position_ids.detach().clone()  # a copy: the caller's buffer may be refilled
        self._mask: Optional[Tensor] = None
        self._block_mask: Any = None
        self.spans: list[list[tuple[int, int]]] = []
        self.per_document = False
        shapes_only = _shapes_only(position_ids)
        self.flex = self.device.type == "cuda" and not shapes_only and _flex() is not None
        if not self.flex:
            # Fake or meta positions (the balanced split costing the layers) have no values: each row one document,
            # what one device's attention over the row costs at most (TextDataModule.example_batch's own rows).
            starts = [[0]] * self.shape[0] if shapes_only else _document_starts(self._position_ids)
            length = self.shape[-1]
            for row in starts:
                bounds = [*row, length]
                self.spans.append(list(zip(bounds[:-1], bounds[1:])))
            calls = sum(len(row) for row in self.spans)
            pairs = sum((b - a) * (b - a + 1) // 2 for row in self.spans for a, b in row)
            self.per_document = calls * CALL_COST_PAIRS + pairs < len(self.spans) * length * length

    def mask(self) -> Tensor:
        """The block-diagonal causal mask (B, 1, T, T), built on first use."""
        if self._mask is None:
            self._mask = _document_causal_mask(self._position_ids)
        return self._mask

    def block_mask(self) -> Any:
        """``flex_attention``'s block mask of the documents (CUDA), built on first use."""
        if self._block_mask is None:
            _, create_block_mask = _flex()
            docs = document_ids(self._position_ids)

            def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                return (docs[b, q] == docs[b, kv]) & (q >= kv)

            batch, length = self.shape
            self._block_mask = create_block_mask(same_document_causal, batch, None, length, length, device=self.device)
        return self._block_mask

    @property
    def skips_masked_blocks(self) -> bool:
        """Whether attention computes only each document's blocks (no (T, T) mask)."""
        return self.flex or self.per_document


def _shapes_only(t: Tensor) -> bool:
    """Whether ``t`` has a shape and no values to read (a fake tensor, or one on the meta device)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.is_meta or is_fake(t)


def _document_starts(position_ids: Tensor) -> list[list[int]]:
    """Each row's document starts (host ints): the first token and wherever a position is not its predecessor's
    plus one."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[..., 1:] = position_ids[..., 1:] != position_ids[..., :-1] + 1
    return [torch.nonzero(row).flatten().tolist() for row in starts.cpu()]


_flex_functions: Any = None


def _flex() -> Any:
    """(``flex_attention``, ``create_block_mask``), compiled, or None where torch has no flex attention."""
    global _flex_functions
    if _flex_functions is None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        except ImportError:
            _flex_functions = False
        else:
            # Both compiled: flex attention's eager form computes every block; create_block_mask's evaluates the
            # whole (T, T) mask (compiled, one graph serves every microbatch of a shape: the documents are an input).
            _flex_functions = (torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask, dynamic=False))
    return _flex_functions or None


def documents(position_ids: Tensor) -> Documents:
    """The :class:`Documents` of a microbatch's positions, built once per microbatch on a stage (:func:`per_positions`)."""
    return per_positions(position_ids, "documents", lambda: Documents(position_ids))


@torch.compiler.disable
def document_attention(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor, *, dropout_p: float = 0.0,
                       scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """Causal attention (B, heads, T, head_dim) within each document of ``position_ids`` (B, T), equal to SDPA
    through :func:`document_causal_mask` (float rounding apart): on CPU document by document with SDPA's causal
    kernel (or through the mask where that is cheaper, :class:`Documents`), on CUDA by ``flex_attention`` with a
    block mask (the mask where there is dropout, which flex attention lacks). The :class:`Documents` are built once
    per microbatch on a stage. Compiled layers call this eagerly: a document's bounds are host integers a compiled
    graph would recompile for."""
    return attend_documents(q, k, v, documents(position_ids), dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa)


def attend_documents(q: Tensor, k: Tensor, v: Tensor, docs: Documents, *, dropout_p: float = 0.0,
                     scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """:func:`document_attention` given the microbatch's :class:`Documents`."""
    if docs.flex and dropout_p == 0.0:
        flex_attention, _ = _flex()
        return flex_attention(q, k, v, block_mask=docs.block_mask(), scale=scale, enable_gqa=enable_gqa)
    if not docs.per_document:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(), dropout_p=dropout_p, scale=scale,
                                              enable_gqa=enable_gqa)
    # split, not sliced: a split's backward joins the documents' gradients in one copy, where each slice's would
    # fill a zero tensor of the whole row
    rows = []
    for qb, kb, vb, spans in zip(q.split(1), k.split(1), v.split(1), docs.spans):
        lengths = [e - s for s, e in spans]
        rows.append(torch.cat([
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, dropout_p=dropout_p, scale=scale,
                                           enable_gqa=enable_gqa)
            for qd, kd, vd in zip(qb.split(lengths, dim=2), kb.split(lengths, dim=2), vb.split(lengths, dim=2))],
            dim=2))
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


def document_targets(batch: Mapping[str, Tensor], skip_document_ends: bool) -> Tensor:
    """The targets (B, T) of a packed batch: ``input_ids[:, 1:]``; with ``skip_document_ends`` a target that starts
    a document (its position is 0: the next document's first token, predicted from the previous one's end) is
    :data:`IGNORE`."""
    targets = batch[INPUT_IDS][:, 1:]
    if not skip_document_ends:
        return targets
    return targets.masked_fill(batch[POSITION_IDS][:, 1:] == 0, IGNORE)


def check_documents_to_skip(batch: Any, skip_document_ends: bool, who: str) -> None:
    """Refuse ``skip_document_ends=True`` on a batch of token rows (a tensor, not a packed batch): it has no documents
    whose ends could be skipped, and the loss would silently take every target (the data module refuses its own
    token rows at setup; a user's own rows reach the loss). Asked by :func:`loss_weight`, which the pipeline calls
    on each batch it trains or evaluates and not on the sample it costs the layers on (token rows whatever the
    data: docs/design/planner.md)."""
    if skip_document_ends and isinstance(batch, Tensor):
        raise ValueError(f"{who} has skip_document_ends=True but got a batch of token rows ({batch.dtype} "
                         f"{tuple(batch.shape)}), which has no documents whose ends could be skipped: give packed "
                         f"batches {{{INPUT_IDS!r}, {POSITION_IDS!r}}} (positions restarting at each document: "
                         f"data.TextDataModule(document_mask=True)), or set skip_document_ends=False")


def document_loss(logits: Tensor, batch: Mapping[str, Tensor], skip_document_ends: bool) -> Tensor:
    """Cross-entropy (float32) of ``logits`` (B, T, V) against :func:`document_targets`, the mean over the kept
    targets; 0 (with a gradient of zeros) for a microbatch whose every target is skipped, where the mean would be
    NaN (rows of one-token documents)."""
    targets = document_targets(batch, skip_document_ends).flatten()
    total = F.cross_entropy(logits.flatten(0, 1).float(), targets, ignore_index=IGNORE, reduction="sum")
    return total / (targets != IGNORE).sum().clamp(min=1)


def loss_weight(batch: Any, skip_document_ends: bool, who: str = "the model") -> Any:
    """A microbatch's weight in its batch's mean loss (``PipelineModule.pipeline_loss_weight``): its rows, or with
    ``skip_document_ends`` on a packed batch its kept targets (a tensor: counted where the batch is), so that the batch
    loss is the mean over the batch's kept targets whatever the microbatch count. ``skip_document_ends`` on token
    rows is refused, naming ``who`` (:func:`check_documents_to_skip`)."""
    check_documents_to_skip(batch, skip_document_ends, who)
    if isinstance(batch, Tensor) or not skip_document_ends:
        return (batch if isinstance(batch, Tensor) else batch[INPUT_IDS]).shape[0]
    return (document_targets(batch, True) != IGNORE).sum()


def packed_input(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """What the first layer takes from a packed batch: all but the last column of its ids and positions."""
    return {INPUT_IDS: batch[INPUT_IDS][:, :-1], POSITION_IDS: batch[POSITION_IDS][:, :-1]}


def model_input(batch: Any, who: str, tensor_parallel_size: int = 1) -> Any:
    """What a built-in model's first layer takes: a row of token ids without its last column, or a checked packed
    batch's ids and positions likewise (``who`` names the model in the refusal). With ``tensor_parallel_size > 1``
    the model's sequence-parallel plan splits each row's tokens over the ranks: a row ``t`` does not split is
    refused (a packed batch's too; its positions stay whole on every rank, for the attention, split by heads, to
    find every document)."""
    t = tensor_parallel_size
    x = batch[:, :-1] if isinstance(batch, Tensor) else packed_input(check_packed(batch, who))
    length = (x if isinstance(x, Tensor) else x[INPUT_IDS]).shape[1]
    if t > 1 and length % t != 0:
        raise ValueError(f"{who} with tensor_parallel_size={t} splits each row's {length} input tokens over the "
                         f"tensor-parallel ranks (sequence parallelism): use a sequence length divisible by {t}")
    return x


def token_row(length: int) -> Tensor:
    """One row of ``length`` tokens and its target: a built-in model's example microbatch for costing its layers."""
    return torch.zeros(1, length + 1, dtype=torch.long)
