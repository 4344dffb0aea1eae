"""Expert parallelism: each stage's mixture-of-experts layers split their experts over an expert group of its ranks.

``AsyncPipelineStrategy(expert_parallel_size=e)``: the ``e`` consecutive data-parallel replicas of a stage form an
expert group (``MeshLayout.expert_parallel_ranks``); each holds ``E / e`` whole experts of every MoE layer of the
stage, the block ``[r E / e, (r + 1) E / e)`` for its place ``r`` in the group, everything else as today. Tokens
travel to their experts and back by two all-to-alls over the group (:func:`run_experts`); the ranks of a group
belong to different replicas, which run the same schedule in lockstep, so their all-to-alls pair up, forward and
backward. See docs/design/expert-parallel.md.

A model holds a layer's experts in :class:`LocalExperts` (each under its global index, so names and checkpoints are
the same whatever ``e``), routes tokens with its own router and calls :func:`run_experts`; the engine finds the
expert parameters through :func:`expert_parameters` and treats their gradients by :class:`ExpertGradients`: not
averaged with the replicas that hold other experts, summed over the ranks that hold the same ones (where
``e`` is less than the replicas) and divided by the number of replicas, so that every update is the one-device
update on all replicas' batches. No Lightning here.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn


def refuse_with_expert_parallelism(config: Any) -> None:
    """The options ``expert_parallel_size > 1`` does not run (yet), refused from ``PipelineConfig`` before any
    process starts, each naming the option and what to use instead."""
    from lightning_async_pp.parallel.mesh import expert_size_message

    e, r, t = config.expert_parallel_size, config.data_parallel_size, config.tensor_parallel_size
    if (r * t) % e != 0:
        raise ValueError(expert_size_message(e, r, t))
    unsupported = [
        (t > 1, f"tensor_parallel_size={t}", "use tensor_parallel_size=1"),
        # zb_h1 splits each backward into an input and a weight pass; that every all-to-all of the experts still
        # runs once, paired across the group, in that split is not verified
        (config.schedule == "zb_h1", "schedule='zb_h1'", "use schedule='1f1b' (the same updates) or '2bw'"),
        (config.shard_optimizer, "shard_optimizer=True", "use shard_optimizer=False (ZeRO-1 would split the "
         "replicas' different experts as if they were copies)"),
        (config.compile is not False, f"compile={config.compile!r}", "use compile=False"),
        # rank 0 alone would time the layers: an MoE layer's all-to-all waits for the rest of its group
        (config.layer_cost != "flops", f"layer_cost={config.layer_cost!r}", "use layer_cost='flops'"),
    ]
    for refused, what, instead in unsupported:
        if refused:
            raise ValueError(f"{what} is not supported with expert_parallel_size > 1 yet "
                             f"(expert_parallel_size={e}); {instead}")


def check_experts_divide(expert_parallel_size: int, num_experts: int, where: str = "the model") -> None:
    """Refuse an ``expert_parallel_size`` that does not split ``num_experts`` evenly, naming both and what works."""
    e, n = expert_parallel_size, num_experts
    if n % e != 0:
        valid = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(f"expert_parallel_size={e} does not divide {where}'s num_experts={n}: each rank of an expert "
                         f"group holds an equal share of whole experts; use an expert_parallel_size among {valid}")


def expert_parallel_mesh(mesh: Any) -> Any:
    """The ``"expert_parallel"`` dimension of ``mesh`` (a model's ``self.device_mesh``) where it splits experts over
    more than one rank, else ``None``: what a model's ``configure_model`` shards its experts over."""
    if mesh is None or "expert_parallel" not in (mesh.mesh_dim_names or ()):
        return None
    ep_mesh = mesh["expert_parallel"]
    return ep_mesh if ep_mesh.size() > 1 else None


class LocalExperts(nn.ModuleDict):
    """The experts of one MoE layer that this process holds, each under its global index: the names
    (``experts.5.up_proj.weight``) are those of a ``ModuleList`` of all ``num_experts``, on one device and under any
    expert-parallel size, so state dicts and checkpoints name every expert alike."""

    def __init__(self, experts: Sequence[nn.Module]) -> None:
        super().__init__({str(j): expert for j, expert in enumerate(experts)})
        self.num_experts = len(experts)
        self.first = 0  # the global index of the first expert held
        self.mesh: Any = None  # the expert group's 1-D DeviceMesh once sharded (None: every expert here)

    @property
    def group_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size()

    def shard(self, mesh: Any, where: str = "the model") -> None:
        """Keep this rank's ``num_experts / e`` consecutive experts of the expert group ``mesh`` (its place ``r`` in
        the group: experts ``r E / e`` onwards), dropping the others before they get memory."""
        e, r = mesh.size(), mesh.get_local_rank()
        check_experts_divide(e, self.num_experts, where)
        per = self.num_experts // e
        for j in range(self.num_experts):
            if not r * per <= j < (r + 1) * per:
                del self[str(j)]
        self.first, self.mesh = r * per, mesh

    def unshard(self) -> None:
        """Hold every expert again, as on one device: the missing ones as copies of a held one (their values to be
        loaded next: the gather into rank 0 after a trainer call), computed here without the group."""
        template = next(iter(self.values()))
        for j in range(self.num_experts):
            if str(j) not in self:
                self[str(j)] = copy.deepcopy(template)
        self._modules = dict(sorted(self._modules.items(), key=lambda item: int(item[0])))  # state-dict order
        self.first, self.mesh = 0, None


def expert_parameters(modules: Iterable[nn.Module]) -> set[int]:
    """The ids of the parameters held in :class:`LocalExperts` anywhere under ``modules``."""
    return {id(p) for module in modules for m in module.modules() if isinstance(m, LocalExperts)
            for p in m.parameters()}


def expert_names(module: nn.Module) -> set[str]:
    """The names (in ``module``) of the expert parameters it holds."""
    experts = expert_parameters([module])
    return {name for name, p in module.named_parameters() if id(p) in experts}


def expert_entries(flat: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """The entries of a checkpoint's flat dictionary (lightning_async_pp/checkpoint/) that belong to the parameters
    ``names`` (weights, stashed versions, optimizer state): what a replica other than the first writes, its own
    experts under their global names."""
    from lightning_async_pp.checkpoint import MODEL, OPTIM, STASH

    def parameter(key: str) -> Optional[str]:
        if key.startswith(MODEL):
            return key[len(MODEL):]
        if key.startswith(STASH):
            return key[len(STASH):].split(".", 1)[1]
        if key.startswith(OPTIM):
            return key.split("/", 2)[1]
        return None

    return {k: v for k, v in flat.items() if parameter(k) in names}


def unshard_experts(modules: Iterable[nn.Module]) -> None:
    """Every :class:`LocalExperts` under ``modules`` holds all its experts again (:meth:`LocalExperts.unshard`)."""
    for experts in {id(m): m for module in modules for m in module.modules() if isinstance(m, LocalExperts)}.values():
        experts.unshard()


def route(router_logits: Tensor, top_k: int, normalize: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Token-choice top-k routing as Mixtral and Qwen3-MoE route: softmax in float32 over the experts, the top
    ``top_k``, renormalized to sum 1 where ``normalize``; then each row's choices sorted by expert index (the order
    upstream adds the experts' outputs in). Returns the weights in ``dtype`` and the experts, both ``(tokens, k)``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    chosen, order = chosen.sort(dim=-1)
    return weights.gather(-1, order).to(dtype), chosen


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits, differentiable: its backward is the all-to-all back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def run_experts(x: Tensor, weights: Tensor, chosen: Tensor, experts: LocalExperts) -> Tensor:
    """``sum_j weights[n, j] * expert_{chosen[n, j]}(x[n])`` for every token ``n`` of ``x`` (tokens, hidden), the
    ``k`` products added in the order of ``chosen``'s columns (ascending experts, from :func:`route`): dropless.

    The token copies are grouped by expert; each held expert runs once on all of its rows (an expert chosen by no
    token runs on none, so its gradient is zero, not missing, as on one device). Across an expert group they travel
    by an all-to-all to the expert's rank and back by another, after one all-to-all of the counts per expert, whose
    values are this layer's one host read (the split sizes); the backward is the same all-to-alls reversed. Under
    ``FakeTensorMode`` (the split's cost model) every expert gets an equal share of the rows, without communication.
    """
    tokens, k = chosen.shape
    num_experts, e = experts.num_experts, experts.group_size
    held = num_experts // e
    flat = chosen.reshape(-1)  # assignment a = n * k + j
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, tokens ascending in each
    rows = x[order // k]
    if _is_fake(x):
        share = -(-tokens * k // held)
        out = _apply(experts, rows, [min(share, max(0, tokens * k - i * share)) for i in range(held)])
        return _combine(out, order, weights)
    # rows per expert (bincount would read its input's maximum on the host first, on CUDA)
    counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    if e == 1:
        return _combine(_apply(experts, rows, counts.tolist()), order, weights)  # the one host read
    group = experts.mesh.get_group()
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # (source, held expert): rows each source sends
    both = torch.cat([counts, received]).tolist()  # the one host read
    sent_per_expert, received_per = both[:num_experts], both[num_experts:]
    send = [sum(sent_per_expert[r * held : (r + 1) * held]) for r in range(e)]
    recv = [sum(received_per[s * held : (s + 1) * held]) for s in range(e)]
    arrived = _AllToAll.apply(rows, recv, send, group)  # by source, then expert within it
    # by expert, then source: each held expert's rows together
    expert_of_row = torch.repeat_interleave(torch.arange(held, device=x.device).repeat(e), received,
                                            output_size=sum(recv))
    by_expert = torch.argsort(expert_of_row, stable=True)
    sizes = [sum(received_per[s * held + i] for s in range(e)) for i in range(held)]
    computed = _apply(experts, arrived[by_expert], sizes)
    return _combine(_AllToAll.apply(computed[torch.argsort(by_expert)], send, recv, group), order, weights)


def _combine(out: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """The expert outputs ``out`` (one row per assignment, in ``order``) weighted and added per token, in upstream's
    order: its loop over experts adds each one's products in turn (ascending experts: ``route`` sorted them)."""
    tokens, k = weights.shape
    products = out[torch.argsort(order)].view(tokens, k, -1) * weights.unsqueeze(-1)
    combined = products[:, 0]
    for j in range(1, k):
        combined = combined + products[:, j]
    return combined


def _apply(experts: LocalExperts, rows: Tensor, sizes: Sequence[int]) -> Tensor:
    """Each held expert (in index order) on its block of ``rows`` (``sizes[i]`` rows for the ``i``-th)."""
    chunks = torch.split(rows, list(sizes))
    return torch.cat([experts[str(experts.first + i)](chunk) for i, chunk in enumerate(chunks)])


class ExpertGradients:
    """What the engine does with a stage's expert gradients under expert parallelism (docs/design/
    expert-parallel.md, "Gradients"). Each rank's gradient of a held expert already sums its expert group's tokens
    (the all-to-all's backward brought them); the one-device gradient is the mean over all ``replicas``' batches,
    so it is summed over the ``copies`` group (the ranks holding the same experts: one per expert group) and
    divided by ``replicas``. The data-parallel buckets skip these parameters."""

    #: The tests' control: leave the sums undivided (each replica's share counted as a whole batch's).
    UNAVERAGED = False

    def __init__(self, indices: Sequence[int], copies_group: Any, copies: int, replicas: int) -> None:
        self.indices, self.group, self.copies, self.replicas = list(indices), copies_group, copies, replicas
        self._work: Any = None
        self._flat: Optional[Tensor] = None
        self._due = False  # launched for the last step, not finished yet

    @classmethod
    def of_stage(cls, params: Sequence[Tensor], expert_ids: set[int], copies_group: Any, layout: Any,
                 rank: int) -> "ExpertGradients":
        """The rule for the expert parameters among ``params`` (one stage's, in the engine's order) of ``rank``."""
        copies = len(layout.expert_data_parallel_ranks(rank))
        return cls([i for i, p in enumerate(params) if id(p) in expert_ids], copies_group, copies,
                   layout.data_parallel_size)

    def launch(self, gradients: list[Optional[Tensor]]) -> None:
        """After the batch's last backward: start summing the copies' gradients (nothing to send with one copy)."""
        self._due = True
        if self.copies == 1 or not self.indices:
            return
        grads = [gradients[i] for i in self.indices]
        if any(g is None for g in grads):  # every held expert runs on every microbatch: none is missing
            raise RuntimeError("an expert parameter took no gradient in a training step")
        self._flat = torch.cat([g.reshape(-1) for g in grads])
        self._work = dist.all_reduce(self._flat, group=self.group, async_op=True)

    @property
    def pending(self) -> bool:
        return self._due

    @torch.no_grad()
    def finish(self, gradients: list[Optional[Tensor]]) -> list[Optional[Tensor]]:
        """The last step's expert gradients summed over the copies and divided by the replicas (once per launch)."""
        if not self._due:
            return gradients
        self._due = False
        if self._work is not None:
            self._work.wait()
            self._work = None
            assert self._flat is not None
            offset = 0
            for i in self.indices:
                g = gradients[i]
                assert g is not None
                g.copy_(self._flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            self._flat = None
        for i in self.indices:
            g = gradients[i]
            if g is not None and not self.UNAVERAGED:
                g.div_(self.replicas)
        return gradients


def start_alike(held: nn.Module, layout: Any, rank: int, dp_group: Any, groups: Optional["ExpertGroups"]) -> None:
    """Replicas start from the first replica's weights and buffers, as DDP does (a model initialized differently
    per process, an unseeded run, would otherwise train different models); an expert from the first rank holding
    the same experts (over ``groups.copies_group``), since the replicas elsewhere in its expert group hold others."""
    from lightning_async_pp.parallel.tensor_parallel import local_tensor

    experts, copies_group = expert_parameters([held]), groups.copies_group if groups is not None else None
    first = layout.rank_of(0, layout.coordinates(rank)[1], layout.coordinates(rank)[2])
    for t in [*held.parameters(), *held.buffers()]:
        if id(t) not in experts:
            dist.broadcast(local_tensor(t).data, src=first, group=dp_group)
        elif copies_group is not None:
            dist.broadcast(t.data, src=layout.expert_data_parallel_ranks(rank)[0], group=copies_group)


class ExpertGroups:
    """Expert parallelism on this process, for the engine: its expert group and the copies of its experts (created
    on every rank in one order: ``new_group`` is collective), and, once the stages exist, which parameters are
    experts (:meth:`find`)."""

    def __init__(self, layout: Any, rank: int) -> None:
        self.layout, self.rank = layout, rank
        self.group, self.copies_group = create_expert_groups(layout, rank)
        self.ids: set[int] = set()

    def gradients(self, stages: Sequence[Any]) -> ExpertGradients:
        """The rule for the expert gradients of ``stages`` (the engine's, one here), whose expert parameters
        (``ids``) are found now."""
        self.ids = expert_parameters(stage.layers for stage in stages)
        params = [p for stage in stages for p in stage.params]
        return ExpertGradients.of_stage(params, self.ids, self.copies_group, self.layout, self.rank)

    def square_sum(self, params: Sequence[Tensor], device: torch.device) -> Tensor:
        """The squared norm of the experts' gradients among ``params``, each of the stage's experts counted once."""
        return expert_square_sum([p.grad for p in params if id(p) in self.ids], self.group, device)


def create_expert_groups(layout: Any, rank: int) -> tuple[Any, Any]:
    """This rank's expert group and its copies group (:meth:`MeshLayout.expert_data_parallel_ranks`; ``None`` where
    no other rank holds the same experts), created on every rank in one order (``new_group`` is collective)."""
    mine: list[Any] = [None, None]
    done: set[tuple[int, ...]] = set()
    for r in range(layout.world_size):
        for slot, ranks in enumerate((layout.expert_parallel_ranks(r), layout.expert_data_parallel_ranks(r))):
            key = (slot, *ranks)
            if key in done or len(ranks) == 1:
                continue
            done.add(key)
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[slot] = group
    return mine[0], mine[1]


def expert_square_sum(grads: Sequence[Tensor], group: Any, device: torch.device) -> Tensor:
    """The squared norm of the stage's expert gradients, each expert counted once: this rank's held experts' squares
    summed over its expert group (which holds every expert of the stage once)."""
    sq = (torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) ** 2 for g in grads]).sum()
          if grads else torch.zeros((), device=device))
    if group is not None:
        dist.all_reduce(sq, group=group)
    return sq
