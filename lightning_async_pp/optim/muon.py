"""``Muon``: ``torch.optim.Muon`` for hidden 2-D matrices and ``torch.optim.AdamW`` for the rest, as one optimizer.

Muon only makes sense for (and ``torch.optim.Muon`` only accepts) the 2-D weight matrices of hidden layers;
embeddings, the output head, norms and biases belong with AdamW. LightningCLI's ``optimizer:`` key hands
the whole ``model.parameters()`` to a single class, so the split has to live inside one optimizer object.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import AdamW, Optimizer

from lightning_async_pp.optim.empty import empty_parameter_lists_allowed

#: A 2-D parameter whose dotted name has one of these components goes to AdamW (embeddings and output heads).
DEFAULT_ADAMW_NAMES: tuple[str, ...] = (
    "embedding", "embeddings", "embed", "embed_tokens", "tok_embeddings", "wte", "wpe", "head", "lm_head", "output",
)


class Muon(Optimizer):
    """Muon for hidden 2-D weight matrices and AdamW for everything else, under one ``lr`` and ``weight_decay``.

    The Muon part is ``torch.optim.Muon(..., adjust_lr_fn="match_rms_adamw")`` (its updates have AdamW's RMS,
    so one learning rate serves both parts); the AdamW part is ``torch.optim.AdamW(betas=adamw_betas,
    eps=adamw_eps)``. Both are real ``torch.optim`` optimizers, reachable as :attr:`muon` and :attr:`adamw`
    (``None`` when that part got no parameters).

    Routing of each parameter, first rule that applies:

    1. its param group carries ``use_muon: bool``;
    2. the tensor itself carries an attribute ``use_muon`` (a model can tag its embeddings this way, which
       works even when only ``model.parameters()`` reaches the optimizer, as under LightningCLI);
    3. a tensor that is not 2-D goes to AdamW;
    4. a 2-D tensor passed with a name (``model.named_parameters()``) goes to AdamW if a dotted component of
       the name is in ``adamw_names`` (default :data:`DEFAULT_ADAMW_NAMES`: ``embedding``, ``head``, ...);
    5. every other 2-D tensor goes to Muon.

    Guarantees:

    - ``param_groups`` *are* the two parts' group dicts (the same objects), in the order the groups were
      given (a given group split in two gives its Muon half first), each tagged ``use_muon``; setting
      ``lr`` or ``weight_decay`` there (as LR schedulers do) changes what that part uses.
    - ``step(closure)`` evaluates the closure once, then steps both parts.
    - ``state`` is a live view of both parts' per-parameter state, keyed by parameter.
    - ``state_dict()`` has the ordinary ``torch.optim`` layout (``state`` keyed by parameter index,
      ``param_groups`` with ``use_muon``); ``load_state_dict`` hands each part its share, so a checkpoint
      continues exactly. Loading into an optimizer whose groups are routed differently raises ``ValueError``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_names: Sequence[str] = DEFAULT_ADAMW_NAMES,
    ) -> None:
        params = list(params)
        if not params and not empty_parameter_lists_allowed():  # allowed: a pipeline stage with nothing to train
            raise ValueError("Muon got an empty parameter list; pass model.parameters() or model.named_parameters()")
        self.adamw_names = frozenset(adamw_names)
        self._muon_defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            adjust_lr_fn="match_rms_adamw",
        )
        self._adamw_defaults = dict(lr=lr, weight_decay=weight_decay, betas=tuple(adamw_betas), eps=adamw_eps)
        self.muon: Optional[torch.optim.Muon] = None
        self.adamw: Optional[AdamW] = None
        self._uses_muon: dict[Tensor, bool] = {}  # parameter -> which part owns it
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            adamw_betas=tuple(adamw_betas), adamw_eps=adamw_eps,
        )
        super().__init__(params, defaults)  # calls add_param_group (below) for each group
        if not any(group["params"] for group in self.param_groups) and not empty_parameter_lists_allowed():
            raise ValueError("Muon got parameter groups without any parameters")
        self.state = _PartsState(self)

    def _part(self, use_muon: bool) -> Optional[Optimizer]:
        return self.muon if use_muon else self.adamw

    def _parts(self) -> list[Optimizer]:
        return [part for part in (self.muon, self.adamw) if part is not None]

    def _routes_to_muon(self, name: Optional[str], param: Tensor) -> bool:
        tag = getattr(param, "use_muon", None)
        if tag is not None:
            return bool(tag)
        if param.ndim != 2:
            return False
        return name is None or self.adamw_names.isdisjoint(name.split("."))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split ``param_group`` by the routing rules and add each half to its part (creating the part if needed)."""
        group = dict(param_group)
        params = group.pop("params")
        items = [params] if isinstance(params, Tensor) else list(params)
        explicit = group.pop("use_muon", None)
        halves: dict[bool, list[Any]] = {True: [], False: []}
        for item in items:
            name, param = item if isinstance(item, tuple) else (None, item)
            if param in self._uses_muon:
                raise ValueError(f"parameter {name or tuple(param.shape)} appears in more than one parameter group")
            use_muon = bool(explicit) if explicit is not None else self._routes_to_muon(name, param)
            halves[use_muon].append(item)
        if not items:
            # An empty group (a replica's share of a group under shard_optimizer=True) belongs to neither part;
            # it is kept so that the group count, and so the positions of the groups, match the template's.
            self.param_groups.append({**group, "params": [], "use_muon": bool(explicit)})
            return
        for use_muon, half in halves.items():
            if not half:
                continue
            part = self._part(use_muon)
            if part is None:
                if use_muon:
                    part = self.muon = torch.optim.Muon([{**group, "params": half}], **self._muon_defaults)
                else:
                    part = self.adamw = AdamW([{**group, "params": half}], **self._adamw_defaults)
            else:
                part.add_param_group({**group, "params": half})
            added = part.param_groups[-1]
            added["use_muon"] = use_muon
            self._uses_muon.update((p, use_muon) for p in added["params"])
            self.param_groups.append(added)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Evaluate ``closure`` (if given) once, then step the Muon part and the AdamW part."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self._parts():
            if part is self.muon and _has_dtensor(part):
                _step_whole_matrices(part)
            else:
                part.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (``torch.optim`` layout): each part loads the groups tagged for it."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has {len(self.param_groups)}"
            )
        shares: dict[bool, dict[str, Any]] = {True: {"state": {}, "param_groups": []}, False: {"state": {}, "param_groups": []}}
        for index, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if not group["params"]:  # an empty group, in no part: only its settings
                group.update({k: v for k, v in saved.items() if k != "params"})
                continue
            use_muon = group["use_muon"]
            if saved.get("use_muon") is not use_muon:
                where = {True: "Muon", False: "AdamW"}
                raise ValueError(
                    f"parameter group {index} goes to {where[use_muon]} here but to "
                    f"{where.get(saved.get('use_muon'), 'neither (no use_muon tag)')} in the loaded state dict"
                )
            share = shares[use_muon]
            start = sum(len(g["params"]) for g in share["param_groups"])
            new_ids = list(range(start, start + len(saved["params"])))
            for old_id, new_id in zip(saved["params"], new_ids):
                if old_id in state_dict["state"]:
                    share["state"][new_id] = state_dict["state"][old_id]
            share["param_groups"].append({**saved, "params": new_ids})
        for use_muon, share in shares.items():
            part = self._part(use_muon)
            if part is not None:
                part.load_state_dict(share)
        # The parts now hold new group dicts; re-point ours in place (same list object, same order).
        new_groups = {use_muon: iter(part.param_groups) for use_muon, part in ((True, self.muon), (False, self.adamw)) if part}
        self.param_groups[:] = [next(new_groups[group["use_muon"]]) if group["params"] else group
                                for group in self.param_groups]
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict[str, Any]:  # keep the parts when pickled or deep-copied
        return self.__dict__.copy()


def _has_dtensor(optimizer: Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


@torch.no_grad()
def _step_whole_matrices(muon: torch.optim.Muon) -> None:
    """``muon.step()`` for matrices split over tensor-parallel ranks (DTensor parameters): the momentum stays a
    local shard (its update is elementwise), the momentum-corrected update is gathered whole, orthogonalized by
    torch's own Newton-Schulz as on one device, and each rank keeps its slice (docs/design/tensor-parallel-shards.md,
    "Muon on sharded matrices"). The steps are ``torch.optim.Muon``'s (``_single_tensor_muon``, torch 2.14) with
    the gather added; tests/test_tensor_parallel.py checks that plain parameters step exactly as ``torch.optim.Muon`` and that
    a sharded matrix's slice is bitwise the whole matrix's step."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    from lightning_async_pp.parallel.tensor_parallel import laid_out_like, whole_value

    for group in muon.param_groups:
        lr = float(group["lr"])
        momentum = group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = muon.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
            ortho = _zeropower_via_newtonschulz(whole_value(update), group["ns_coefficients"], group["ns_steps"],
                                                group["eps"])
            adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], p.shape)  # the global shape, as on one device
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(laid_out_like(ortho, p), alpha=-adjusted_lr)


class _PartsState(MutableMapping):
    """``Muon.state``: per-parameter state, read and written through to the part that owns the parameter.

    Like ``torch.optim``'s ``defaultdict`` state, ``state[p]`` of an owned parameter creates an empty entry.
    """

    def __init__(self, owner: Muon) -> None:
        self._owner = owner

    def _state_of(self, param: Any) -> MutableMapping:
        use_muon = self._owner._uses_muon.get(param) if isinstance(param, Tensor) else None
        if use_muon is None:
            raise KeyError(param)
        return self._owner._part(use_muon).state

    def __getitem__(self, param: Any) -> Any:
        return self._state_of(param)[param]

    def __setitem__(self, param: Any, value: Any) -> None:
        self._state_of(param)[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._state_of(param)[param]

    def __contains__(self, param: object) -> bool:
        return any(param in part.state for part in self._owner._parts())

    def __iter__(self) -> Iterator[Any]:
        for part in self._owner._parts():
            yield from part.state

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._owner._parts())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} parameters)"
