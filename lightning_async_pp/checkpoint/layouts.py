"""A checkpoint in any layout: what this process contributes to the flat dictionary (its stages' weights, stashed
versions and optimizer states, keyed by global names) and which keys it reads back, laid out as its own
parameters are, whatever the number of stages, data-parallel replicas, tensor-parallel ranks or partition that
saved them (docs/design/checkpoints.md, "Checkpoints")."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_async_pp.checkpoint.format import FORMAT, GROUP, MODEL, OPTIM, STASH, read_settings, settings_bytes
from lightning_async_pp.checkpoint.sources import TensorSource
from lightning_async_pp.parallel.tensor_parallel import DTensorSpec, as_laid_out, dtensor_spec, in_blocks
from lightning_async_pp.parallel.zero import local_optimizer, sync_group_settings


# ---- what a process contributes --------------------------------------------------------------------------------
def engine_tensors(engine: Any, module_state: Mapping[str, Tensor], optimizers: Sequence[torch.optim.Optimizer],
                   weights: bool = True) -> dict[str, Any]:
    """This process's part of the flat dictionary: its module state, stashed versions (unless ``weights`` is
    False: a data-parallel replica) and optimizer states (a sharded optimizer: the parameters this process owns)."""
    flat: dict[str, Any] = {MODEL + engine.aliases.get(n, n): t for n, t in module_state.items()} if weights else {}
    for view in engine.stats.stages if weights else ():
        k = engine.stats.batch_index
        # A slot holds a DTensor parameter's local shard: saved as a DTensor laid out as the parameter, so DCP
        # records the global shape and this shard's offset
        # (docs/design/tensor-parallel-shards.md, "Checkpoints of sharded stages").
        specs = [dtensor_spec(p) for p in view.params]
        for o in range(1, min(view.delay, k) + 1):
            flat.update({f"{STASH}{o}.{n}": as_laid_out(t, s)
                         for n, t, s in zip(view.param_names, view.version(k - o), specs)})
        if view.predicts:  # "stash.0": what the batches due the newest version will run on (its prediction)
            flat.update({f"{STASH}0.{n}": as_laid_out(t, s)
                         for n, t, s in zip(view.param_names, view.predicted_newest(), specs)})
    for i, optimizer in enumerate(optimizers):
        flat.update(_optimizer_by_name(optimizer, engine.global_names, f"{OPTIM}{i}/"))
    return in_blocks(flat)  # DCP writes a shard as one block: a strided one is written whole

def _optimizer_by_name(optimizer: torch.optim.Optimizer, names: Mapping[int, str], prefix: str) -> dict[str, Any]:
    # Sharded: the local groups take the exposed groups' settings first (what the next step would use: an LR
    # scheduler changed the exposed ones after the last step), as ZeroRedundancyOptimizer.consolidate_state_dict.
    sync_group_settings(optimizer)
    optimizer = local_optimizer(optimizer)  # sharded: only the state this replica holds
    state = optimizer.state_dict()
    name_of = {index: names[id(p)] for saved, group in zip(state["param_groups"], optimizer.param_groups)
               for index, p in zip(saved["params"], group["params"])}
    return _state_by_name(state, name_of, prefix)

def _state_by_name(state: Mapping[str, Any], name_of: Mapping[int, str], prefix: str) -> dict[str, Any]:
    """A torch optimizer ``state_dict`` (keyed by parameter index) as flat keys of parameter names."""
    out: dict[str, Any] = {}
    for saved in state["param_groups"]:
        hyper = settings_bytes({k: v for k, v in saved.items() if k != "params"})
        for index in saved["params"]:
            name = name_of[index]
            out[f"{prefix}{name}/{GROUP}"] = hyper
            for key, value in state["state"].get(index, {}).items():
                out[f"{prefix}{name}/{key}"] = value
    return out

def plain_optimizer_tensors(optimizer_states: Sequence[Mapping[str, Any]], names: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The optimizer keys of the flat dictionary from a plain Lightning checkpoint, whose ``optimizer_states`` know
    parameters by index only. ``names[i]`` lists optimizer ``i``'s parameter names in index order, as the whole
    model's ``configure_optimizers()`` builds it (what the checkpointed run built)."""
    if len(optimizer_states) != len(names):
        raise ValueError(
            f"the checkpoint holds {len(optimizer_states)} optimizer state(s) but configure_optimizers() returns "
            f"{len(names)} optimizer(s); resume with the optimizers the checkpoint was trained with"
        )
    out: dict[str, Any] = {}
    for i, (state, order) in enumerate(zip(optimizer_states, names)):
        indices = [index for group in state["param_groups"] for index in group["params"]]
        if len(indices) != len(order):
            raise ValueError(
                f"optimizer {i} of the checkpoint holds {len(indices)} parameters, but the model's "
                f"configure_optimizers() gives it {len(order)}; resume with the model and optimizer it was trained with"
            )
        out.update(_state_by_name(state, dict(zip(indices, order)), f"{OPTIM}{i}/"))
    return out

def checkpoint_meta(engine: Any, schedule: str, data_parallel_size: int) -> dict[str, Any]:
    return {
        "format": FORMAT, "schedule": schedule, "num_stages": engine.num_stages,
        "data_parallel_size": data_parallel_size, "num_updates": engine.stats.batch_index,
        "aliases": dict(engine.aliases), "layers_per_stage": list(engine.split.counts),
    }


# ---- loading into a layout ---------------------------------------------------------------------------------------
def model_key(engine: Any, name: str) -> str:
    return MODEL + engine.aliases.get(name, name)

def check_model_fits(engine: Any, module_state: Mapping[str, Tensor], source: TensorSource, whole_model: bool,
                     check: Callable[[dict, dict, str], None], strict: bool = True) -> None:
    """Names and shapes of the module state against the checkpoint's (all of them when this process holds the
    whole model, else those of its own stage). Not ``strict``: only the shapes of the names both have, as
    ``Module.load_state_dict(strict=False)`` (missing and unexpected names are left out)."""
    expected = {engine.aliases.get(n, n): tuple(t.shape) for n, t in module_state.items()}
    found = {k[len(MODEL):]: tuple(shape[0]) for k, shape in source.shapes.items()
             if k.startswith(MODEL) and shape is not None and (whole_model or k[len(MODEL):] in expected)}
    if not strict:
        expected = {n: shape for n, shape in expected.items() if n in found}
        found = {n: shape for n, shape in found.items() if n in expected}
    check(expected, found, "the model's state_dict")

def needed_keys(engine: Any, module_state_names: Iterable[str], source: TensorSource,
                optimizer_owned: Optional[set[str]] = None) -> list[str]:
    """The keys this process reads: its module state, the stashed versions its stages hold under their delay
    (those the checkpoint has) and its parameters' optimizer states (with ``optimizer_owned``, a sharded
    optimizer's names: only those parameters' state, and every parameter's group settings)."""
    keys = {model_key(engine, n) for n in module_state_names}
    for view in engine.stats.stages:
        for o in range(0 if view.predicts else 1, view.delay + 1):
            keys.update(f"{STASH}{o}.{n}" for n in view.param_names)
    own = {n for view in engine.stats.stages for n in view.param_names}
    keys.update(k for k in source.shapes if k.startswith(OPTIM) and k.split("/", 2)[1] in own
                and (optimizer_owned is None or k.endswith("/" + GROUP) or k.split("/", 2)[1] in optimizer_owned))
    return sorted(k for k in keys if k in source.shapes)

def layouts(engine: Any, keys: Iterable[str], source: TensorSource) -> dict[str, DTensorSpec]:
    """The keys among ``keys`` that this process holds as DTensors (tensor parallelism) and how: a DTensor
    parameter's weights (``model.``, ``stash.``) and its optimizer state of the parameter's shape, laid out as the
    parameter (a scalar such as AdamW's ``step`` stays whole), or of its shape behind one more leading dimension
    (``DelayCompensation``'s stacked weight history), laid out as the parameter along the others. Empty without
    tensor parallelism."""
    specs = {n: (dtensor_spec(p), tuple(p.shape)) for view in engine.stats.stages
             for n, p in zip(view.param_names, view.params)}
    specs = {n: spec for n, spec in specs.items() if spec[0] is not None}
    if not specs:
        return {}
    out: dict[str, DTensorSpec] = {}
    for key in keys:
        if key.startswith(MODEL):
            name = key[len(MODEL):]
        elif key.startswith(STASH):
            name = key[len(STASH):].split(".", 1)[1]
        elif key.startswith(OPTIM):
            name = key.split("/", 2)[1]
        else:
            continue
        saved = source.shapes.get(key)
        if name not in specs or saved is None:
            continue
        spec, shape = specs[name]
        if tuple(saved[0]) == shape:
            out[key] = spec
        elif key.startswith(OPTIM) and tuple(saved[0][1:]) == shape:
            out[key] = _stacked(spec, int(saved[0][0]))
    return out

def _stacked(spec: DTensorSpec, n: int) -> DTensorSpec:
    """The layout of ``n`` tensors laid out as ``spec`` stacked along a new first dimension: each sharded dimension
    one further on."""
    from torch.distributed.tensor import Shard

    mesh, placements, shape, _ = spec
    shifted = tuple(Shard(p.dim + 1) if p.is_shard() else p for p in placements)
    whole = torch.Size((n, *shape))
    return mesh, shifted, whole, torch.empty(whole, device="meta").stride()

def load_engine(engine: Any, module: nn.Module, tensors: Mapping[str, Any], num_updates: int,
                strict: bool = True) -> None:
    """Load the module state and every held weight version of this process's stages.

    A version the checkpoint lacks (it was saved with a smaller delay: 1f1b -> 2bw) is the newest one: the delay
    starts from the loaded weights, as at the first update of a run. A checkpoint with a larger delay than this
    run (2bw -> 1f1b) continues from its newest weights. Not ``strict``: a parameter or buffer the checkpoint lacks
    keeps its present value (in every version), as ``Module.load_state_dict(strict=False)`` keeps it.
    """
    names = [n for n in module.state_dict() if strict or model_key(engine, n) in tensors]
    module.load_state_dict({n: tensors[model_key(engine, n)] for n in names}, strict=strict)
    stages: dict[str, Any] = {}
    for view in engine.stats.stages:
        newest = {n: tensors[MODEL + n] if strict or MODEL + n in tensors else p.detach().clone()
                  for n, p in zip(view.param_names, view.params)}
        versions = {num_updates: newest}
        for o in range(1, min(view.delay, num_updates) + 1):
            versions[num_updates - o] = {n: tensors.get(f"{STASH}{o}.{n}", newest[n]) for n in view.param_names}
        stages[str(view.index)] = {"num_updates": num_updates, "delay": view.delay, "versions": versions}
        if view.predicts and all(f"{STASH}0.{n}" in tensors for n in view.param_names):
            stages[str(view.index)]["predicted_newest"] = {n: tensors[f"{STASH}0.{n}"] for n in view.param_names}
    engine.load_state_dict({"stages": stages})

def has_optimizer_state(source: TensorSource) -> bool:
    return any(k.startswith(OPTIM) for k in source.shapes)

def load_optimizers(optimizers: Sequence[torch.optim.Optimizer], names: Mapping[int, str], tensors: Mapping[str, Any]) -> None:
    """Give each optimizer the saved state and group hyperparameters of its own parameters (by name)."""
    saved: dict[tuple[str, str], dict[str, Any]] = {}  # (optimizer prefix, parameter name) -> {key: value}
    for key, value in tensors.items():
        if key.startswith(OPTIM):
            prefix, name, entry = key.split("/", 2)
            saved.setdefault((prefix, name), {})[entry] = value
    for i, sharded in enumerate(optimizers):
        prefix = f"{OPTIM}{i}"
        optimizer = local_optimizer(sharded)
        if optimizer is not sharded:
            # The exposed groups take the settings saved with their parameters, also where this replica owns
            # none of a group's parameters (its local group is then empty).
            for group in sharded.param_groups:
                hyper = next((saved[(prefix, names[id(p)])][GROUP] for p in group["params"]
                              if GROUP in saved.get((prefix, names[id(p)]), {})), None)
                if hyper is not None:
                    group.update(read_settings(hyper, f"{prefix}/{names[id(group['params'][0])]}/{GROUP}"))
        state: dict[int, dict[str, Any]] = {}
        groups, index = [], 0
        for group in optimizer.param_groups:
            params = list(group["params"])
            hyper = {k: v for k, v in group.items() if k != "params"}
            first = saved.get((prefix, names[id(params[0])]), {}) if params else {}
            if GROUP in first:
                # The saved group's hyperparameters, but not its member list: in another layout the group holds
                # other parameters, and ``param_names`` must stay this group's own.
                settings = read_settings(first[GROUP], f"{prefix}/{names[id(params[0])]}/{GROUP}")
                hyper.update({k: v for k, v in settings.items() if k != "param_names"})
            groups.append({**hyper, "params": list(range(index, index + len(params)))})
            for p in params:
                entry = {k: v for k, v in saved.get((prefix, names[id(p)]), {}).items() if k != GROUP}
                if entry:
                    state[index] = entry
                index += 1
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        sync_group_settings(sharded)

def owned_parameters(optimizers: Sequence[torch.optim.Optimizer], names: Mapping[int, str]) -> Optional[set[str]]:
    """The names of the parameters whose optimizer state this process holds, when its optimizers are sharded
    (``None`` otherwise: it holds them all)."""
    locals_ = [local_optimizer(o) for o in optimizers]
    if all(local is o for local, o in zip(locals_, optimizers)):
        return None
    return {names[id(p)] for local in locals_ for g in local.param_groups for p in g["params"]}
