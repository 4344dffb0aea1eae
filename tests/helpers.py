"""Tiny models and data shared by the tests."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_async_pp import PipelineModule


class TwoOutputs(nn.Module):
    """A layer whose output is a tuple, to check that tuples cross stage boundaries."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x)
        return torch.tanh(h), h.sum(-1, keepdim=True)


class TupleIn(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, s = xs
        return torch.tanh(self.proj(x)) + 0.1 * s


class PassThrough(nn.Module):
    """Returns its very input: a stage made of it sends on the tensor it received, and autograd may keep the
    gradient it receives as that input's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))  # a stage needs a parameter for its optimizer

    def forward(self, x):
        return x


class TinyLM(PipelineModule):
    """Regression MLP with enough layers to split into 4 stages; optionally a tuple crossing a boundary, dropout or
    BatchNorm in the hidden layers."""

    def __init__(self, width: int = 8, depth: int = 4, tuple_boundary: bool = False, optimizer: str = "sgd",
                 fail_at: Optional[dict] = None, seed: int = 0, dropout: float = 0.0,
                 passthrough_at: Optional[int] = None, batchnorm: bool = False, lr_schedule: bool = False,
                 later_group_at: Optional[int] = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(4, width)]
        for i in range(depth - 2):
            if tuple_boundary and i == 0:
                layers += [TwoOutputs(width), TupleIn(width)]
            elif dropout:
                layers.append(nn.Sequential(nn.Tanh(), nn.Dropout(dropout), nn.Linear(width, width)))
            elif batchnorm:  # running statistics: buffers that every training forward changes
                layers.append(nn.Sequential(nn.Tanh(), nn.BatchNorm1d(width), nn.Linear(width, width)))
            else:
                layers.append(nn.Sequential(nn.Tanh(), nn.Linear(width, width)))
        layers.append(nn.Sequential(nn.Tanh(), nn.Linear(width, 1)))
        if passthrough_at is not None:
            layers.insert(passthrough_at, PassThrough())
        self.layers = nn.ModuleList(layers)
        self.optimizer_name = optimizer
        self.fail_at = fail_at  # {"stage": s, "step": k}: raise there (failure tests)
        self.lr_schedule = lr_schedule  # a per-step learning-rate schedule with the optimizer
        # The optimizer starts with the first half of the layers; the rest joins as a new group at this update.
        self.later_group_at = later_group_at

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return ((output - batch[1]) ** 2).mean()

    def training_step(self, batch, batch_idx):
        if self.fail_at and self.global_step == self.fail_at["step"]:
            strategy = self.trainer.strategy
            if getattr(strategy, "topology", None) is not None and strategy.topology.stage == self.fail_at["stage"]:
                raise RuntimeError(f"injected failure at step {self.global_step}")
        return super().training_step(batch, batch_idx)

    def _later_params(self) -> list:
        return [p for layer in self.layers[len(self.layers) // 2:] for p in layer.parameters()]

    def on_train_batch_start(self, batch, batch_idx):
        if self.later_group_at is not None and self.global_step == self.later_group_at:
            self.trainer.optimizers[0].add_param_group({"params": self._later_params()})

    def configure_optimizers(self):
        later = {id(p) for p in self._later_params()} if self.later_group_at is not None else set()
        optimizer = make_optimizer_factory(self.optimizer_name)([p for p in self.parameters() if id(p) not in later])
        if not self.lr_schedule:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1.0 + k))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def make_optimizer_factory(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    if name == "muon_ef":
        return muon_with_correction
    if name == "adamw_ef":
        return adamw_with_correction
    if name == "adamw_wp":
        return adamw_with_prediction
    if name == "grouped_corrections":
        return grouped_corrections
    raise ValueError(name)


def make_dataset(samples: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=g)
    y = torch.sin(x.sum(-1, keepdim=True))
    return TensorDataset(x, y)


class ResumableStream:
    """Batches in a fixed order, with ``state_dict``/``load_state_dict`` so that Lightning can checkpoint the data
    position mid-epoch (plain DataLoaders restart their epoch on resume); no ``__len__``, like a stream."""

    def __init__(self, dataset, batch_size: int) -> None:
        from torch.utils.data import DataLoader

        self.loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)
        self.position = 0
        self._resume_at = 0

    def __iter__(self):
        start, self._resume_at = self._resume_at, 0
        for i, batch in enumerate(self.loader):
            if i >= start:
                self.position = i + 1
                yield batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._resume_at = state["position"]


class ResumableLoader(ResumableStream):
    """A :class:`ResumableStream` with a length, like a DataLoader."""

    def __len__(self) -> int:
        return len(self.loader)


def one_device_trainer(strategy=None, steps: int = 6, **kwargs):
    """A quiet one-device CPU Trainer (no logger, checkpoints, progress bar or sanity check) for ``steps`` updates."""
    import lightning as L

    defaults = dict(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    defaults.update(kwargs)
    if strategy is not None:
        defaults["strategy"] = strategy
    return L.Trainer(**defaults)


def adamw_with_correction(params):
    from lightning_async_pp.optim import ErrorFeedback

    return ErrorFeedback(params, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), coefficient=1.0)


def adamw_with_prediction(params):
    from lightning_async_pp.optim import WeightPrediction

    return WeightPrediction(params, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), scale=0.7)


def muon_with_correction(params):
    from lightning_async_pp.optim import ErrorFeedback, Muon

    return ErrorFeedback(params, optimizer=lambda p: Muon(p, lr=0.02), coefficient=1.0)


def grouped_corrections(params):
    """ErrorFeedback(DelayCompensation(AsyncNesterov)) for 2BW (delay 1) over three parameter groups: the large
    matrices (named, coefficient 0: no correction, so the corrections cost next to nothing at width 1024), the
    vectors (coefficient 2, their own NAdam beta1) and the small matrices (coefficient 0.5)."""
    from functools import partial

    from lightning_async_pp.optim import AsyncNesterov, DelayCompensation, ErrorFeedback

    params = list(params)
    large = [p for p in params if p.dim() >= 2 and p.numel() > 4096]
    groups = [{"params": large, "name": "matrices", "coefficient": 0.0},
              {"params": [p for p in params if p.dim() < 2], "coefficient": 2.0, "betas": (0.95, 0.999)},
              {"params": [p for p in params if p.dim() >= 2 and p.numel() <= 4096], "coefficient": 0.5}]
    return ErrorFeedback(groups, optimizer=partial(DelayCompensation, optimizer=partial(AsyncNesterov, lr=0.01), delay=1))


def delayed_loop(model, batches, delay: int = 1, version_of=None) -> dict:
    """docs/design/update-rule.md's update rule written out: W_{k+1} = W_k - U(grad f(W_{max(k-delay,0)}; B_k)) (or the
    version ``version_of(k)``); optimizer state never rewound.

    ``batches`` is the whole sequence B_0, B_1, ... (one update each). Returns the final ``state_dict`` (copied).
    """
    version_of = version_of or (lambda k: max(k - delay, 0))
    opt = model.configure_optimizers()
    params = list(model.parameters())  # a tied weight is listed once
    history = [[p.detach().clone() for p in params]]
    for k, batch in enumerate(batches):
        current = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, w in zip(params, history[version_of(k)]):
                p.copy_(w)
        opt.zero_grad()
        model.pipeline_loss(model.pipeline_forward(batch), batch).backward()
        with torch.no_grad():
            for p, w in zip(params, current):
                p.copy_(w)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def script_main(run) -> None:
    """The entry of the multi-process test scripts (tests/scripts/): ``run(cfg, devices=...)`` on every rank, each
    saving what it returned to ``OUT/rank{r}.pt``."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True, help="folder for rank{r}.pt")
    args = parser.parse_args()
    cfg = json.loads(args.config)
    torch.set_num_threads(1)
    result, _, trainer = run(cfg, devices=cfg.get("devices", 2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


def load_example(name: str):
    """The module of ``examples/<name>.py`` (the examples are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
