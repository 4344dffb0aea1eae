"""Where the pipeline meets Lightning (tests/test_lightning_seam.py): hooks, samplers, tied weights, nested
activations, calls after ``fit``.

Builds a model, a loader and a Trainer from a JSON config, runs ``fit`` (then optionally ``validate``, ``test``,
``predict``) and every rank saves what it saw to ``OUT/rank{r}.pt``: the hook calls, the batches it trained on,
and on rank 0 the final ``state_dict`` and the results of the calls after ``fit``.

Run as a script in a subprocess (Lightning's launcher re-executes it for the other ranks); the tests also import
it to build the same model, data and run on one device in their own process (``run(cfg, devices=1)``).

Config keys (all optional but ``steps`` or ``max_epochs``):
    model: {"name": "tiny" | "tied" | "dict", ...constructor kwargs}
    seam: {"modify": "targets" | "inputs", "cut_at": int, "record_batches": bool}  (see SeamHooks)
    data: {"kind": "seq" | "shuffle" | "unsized" | "by_rank", "samples", "batch", "drop_last"}
    eval_data: the same, for validate/test/predict after fit
    after: ["validate", "test", "predict"], in that order
    seed: L.seed_everything(seed) before anything else;  rng_per_rank: each process's global RNG differs
    clip, clip_algorithm: Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)
    cases: {name: config}: several runs in one launch (run_cases), each result under its name
    schedule, microbatches, partition, timeout, strategy_kwargs, use_distributed_sampler (left at
    Lightning's default unless given), steps, max_epochs, save_every + checkpoint_dir, resume_from,
    val_every (validation on a fixed loader every that many training batches, its losses recorded; given as None:
    at epoch ends), sanity_steps, limit_train_batches, finetuning (see freezing_callbacks)
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import ResumableStream, TinyLM, make_dataset, script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule  # noqa: E402

HOOKS = ("on_before_batch_transfer", "on_after_batch_transfer", "on_train_batch_start", "on_train_batch_end")


def fingerprint(batch: Any) -> float:
    """Identifies a batch by its inputs (taken before any hook changes them)."""
    return round(float(batch[0].double().sum()), 6)


class SeamHooks:
    """Mixin: records every training batch hook call and, when asked, changes batches the way users do.

    ``seam["modify"]``: ``on_before_batch_transfer`` halves the targets (or the inputs) IN PLACE.
    ``seam["cut_at"]``: ``on_train_batch_start`` returns -1 at that ``batch_idx`` (ends the epoch there).
    ``seam["record_batches"]``: keep a copy of every batch trained on (as seen by ``on_train_batch_start``).
    ``seam["stop_at"]``: ``on_train_batch_end`` of that global step sets ``trainer.should_stop`` (stops mid-epoch).
    ``seam["toggle"]``: ``{"layers": [i, ...], "off": a, "on": b}``: those layers need no gradient from step ``a``
    until step ``b`` (set at every ``on_train_batch_start`` from the step alone, so a resumed run agrees).
    """

    def __init__(self, *args: Any, seam: Optional[dict] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seam = dict(seam or {})
        self.calls: dict[str, list] = {name: [] for name in HOOKS}
        self.seen_batches: list = []
        self.losses: list[float] = []  # the training loss of every step
        self.val_losses: list[float] = []  # the loss of every validation during fit

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            self.calls["on_before_batch_transfer"].append(fingerprint(batch))
            if self.seam.get("modify") == "targets":
                batch[1].mul_(0.5)
            elif self.seam.get("modify") == "inputs":
                batch[0].mul_(0.5)
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.training:
            self.calls["on_after_batch_transfer"].append(fingerprint(batch))
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]:
        self.calls["on_train_batch_start"].append(batch_idx)
        toggle = self.seam.get("toggle")
        if toggle:
            frozen = toggle["off"] <= self.trainer.global_step < toggle["on"]
            for i in toggle["layers"]:
                self.layers[i].requires_grad_(not frozen)
        if batch_idx == self.seam.get("cut_at"):
            return -1
        if self.seam.get("record_batches"):
            self.seen_batches.append([t.detach().cpu().clone() for t in batch])
        return None

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.calls["on_train_batch_end"].append(batch_idx)
        self.losses.append(float(outputs["loss"]))
        if self.trainer.global_step == self.seam.get("stop_at"):
            self.trainer.should_stop = True

    def on_validation_epoch_end(self) -> None:
        if self.trainer.state.fn == "fit":  # a validation within fit (val_every)
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))


class LayerFinetuning(L.pytorch.callbacks.BaseFinetuning):
    """Lightning's BaseFinetuning: ``layers`` frozen in setup, made trainable at epoch ``on`` (the optimizer holds
    them from the start)."""

    def __init__(self, layers: list[int], on: int) -> None:
        super().__init__()
        self.layers, self.on = list(layers), on

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze([pl_module.layers[i] for i in self.layers])

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        if epoch == self.on:
            self.make_trainable([pl_module.layers[i] for i in self.layers])


def freezing_callbacks(spec: Optional[dict]) -> list:
    """``cfg["finetuning"]`` = {"layers": [...], "on": epoch} as callbacks (none without it)."""
    return [LayerFinetuning(spec["layers"], spec["on"])] if spec else []


class ClippingChoices:
    """Mixin: the ways besides ``Trainer(gradient_clip_val=...)`` that Lightning offers to clip, by ``clipping``:
    ``{"how": "override", "val": c}``: ``configure_gradient_clipping`` clips by norm ``c`` itself;
    ``{"how": "skip"}``: ``configure_gradient_clipping`` does nothing (the Trainer's value is ignored);
    ``{"how": "manual", "val": c}``: manual optimization, ``self.clip_gradients`` by norm ``c`` before the step.
    """

    def __init__(self, *args: Any, clipping: Optional[dict] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clipping = dict(clipping or {})
        self.automatic_optimization = self.clipping.get("how") != "manual"

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        how = self.clipping.get("how")
        if how == "skip":
            return
        if how == "override":
            self.clip_gradients(optimizer, gradient_clip_val=self.clipping["val"], gradient_clip_algorithm="norm")
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self._loss(batch, batch_idx)
        if self.pipeline_metric_names():  # logged as PipelineModule.training_step logs them
            executor = self._pipeline_executor
            for name, value in (self.pipeline_metrics() if executor is None else executor.train_metrics()).items():
                self.log(name, value)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=self.clipping["val"], gradient_clip_algorithm="norm")
        optimizer.step()
        return loss


class CountedLosses:
    """Mixin: with ``count_losses``, module metrics as an MoE router loss keeps them: every training
    ``pipeline_loss`` call is recorded in the module, and ``pipeline_metrics`` reports (and forgets) how many calls
    the batch made and the sum of their losses; ``metric_values`` keeps what was logged at every step."""

    METRICS = ("train_loss_calls", "train_loss_sum")

    def __init__(self, *args: Any, count_losses: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.count_losses = count_losses
        self._recorded: list[torch.Tensor] = []
        self.metric_values: list[list[float]] = []

    def pipeline_loss(self, output: Any, batch: Any) -> torch.Tensor:
        loss = super().pipeline_loss(output, batch)
        if self.count_losses and self.training and torch.is_grad_enabled():
            self._recorded.append(loss.detach())
        return loss

    def pipeline_metric_names(self) -> tuple[str, ...]:
        return self.METRICS if self.count_losses else ()

    def pipeline_metrics(self) -> dict[str, torch.Tensor]:
        recorded, self._recorded = self._recorded, []
        return {"train_loss_calls": torch.tensor(float(len(recorded))),
                "train_loss_sum": torch.stack(recorded).sum() if recorded else torch.tensor(0.0)}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.count_losses:
            self.metric_values.append([float(self.trainer.callback_metrics[n]) for n in self.METRICS])


class SeamTinyLM(CountedLosses, SeamHooks, ClippingChoices, TinyLM):
    """helpers.TinyLM (regression MLP, ``width``/``depth``/``optimizer``/``dropout``) with the recording hooks,
    the counted losses and the clipping choices."""


class ScheduledTinyLM(SeamTinyLM):
    """SeamTinyLM with a LambdaLR schedule (``1 / (1 + k)``) stepped every ``scheduler_interval`` ("step" or
    "epoch"; ``None``: no schedule)."""

    def __init__(self, scheduler_interval: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scheduler_interval = scheduler_interval

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        if self.scheduler_interval is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 / (1.0 + k))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": self.scheduler_interval}}


class TiedLM(SeamHooks, PipelineModule):
    """Embedding -> block -> block -> head, the head's weight IS the embedding's (``head.weight = embed.weight``).
    ``blocks`` blocks (``block1``, ``block2``, ...); with ``share_blocks`` every block's Linear takes the first
    block's weight and bias, so a split can put one parameter on three stages."""

    def __init__(self, vocab: int = 16, width: int = 8, seed: int = 0, blocks: int = 2, share_blocks: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = blocks
        for i in range(1, blocks + 1):
            block = nn.Sequential(nn.Linear(width, width), nn.Tanh())
            if share_blocks and i > 1:
                block[0].weight, block[0].bias = self.block1[0].weight, self.block1[0].bias
            setattr(self, f"block{i}", block)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def pipeline_layers(self):
        return [self.embed, *(getattr(self, f"block{i}") for i in range(1, self.blocks + 1)), self.head]

    def pipeline_loss(self, logits, batch):
        return nn.functional.cross_entropy(logits, batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


class DictOut(nn.Module):
    """Outputs a dict holding a tensor and a list with a tensor and a None."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.side = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> dict:
        return {"h": torch.tanh(self.proj(x)), "aux": [self.side(x), None]}


class DictIn(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, d: dict) -> torch.Tensor:
        if not (isinstance(d, dict) and isinstance(d["aux"], list) and d["aux"][1] is None):
            raise TypeError(f"expected {{'h': tensor, 'aux': [tensor, None]}}, got {d!r}")
        return torch.tanh(self.proj(d["h"])) + 0.1 * d["aux"][0]


class DictLM(SeamHooks, PipelineModule):
    """Linear -> DictOut | DictIn -> head: with partition [2, 2] the dict crosses the stage boundary."""

    def __init__(self, width: int = 8, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([
            nn.Linear(4, width), DictOut(width), DictIn(width), nn.Sequential(nn.Tanh(), nn.Linear(width, 1)),
        ])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_loss(self, output, batch):
        return ((output - batch[1]) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)


MODELS = {"tiny": SeamTinyLM, "tied": TiedLM, "dict": DictLM, "scheduled": ScheduledTinyLM}


def build_model(cfg: dict) -> PipelineModule:
    spec = dict(cfg.get("model", {}))
    name = spec.pop("name", "tiny")
    return MODELS[name](seam=cfg.get("seam"), **spec)


def make_tokens(samples: int = 64, vocab: int = 16, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (samples,), generator=g)
    return TensorDataset(tokens, (3 * tokens + 1) % vocab)


def build_dataset(cfg: dict, spec: dict, seed: int = 1):
    if cfg.get("model", {}).get("name") == "tied":
        return make_tokens(spec.get("samples", 64), cfg["model"].get("vocab", 16), seed=seed)
    return make_dataset(spec.get("samples", 64), seed=seed)


def build_loader(cfg: dict, spec: Optional[dict] = None):
    spec = dict(spec if spec is not None else cfg.get("data", {}))
    kind = spec.get("kind", "seq")
    seed = 1 + int(os.environ.get("LOCAL_RANK", 0)) if kind == "by_rank" else 1
    dataset = build_dataset(cfg, spec, seed=seed)
    batch = spec.get("batch", 8)
    if kind == "unsized":
        return ResumableStream(dataset, batch)
    return DataLoader(dataset, batch_size=batch, shuffle=kind == "shuffle", drop_last=spec.get("drop_last", True))


def build_strategy(cfg: dict) -> AsyncPipelineStrategy:
    kwargs = dict(cfg.get("strategy_kwargs", {}))
    if "partition" in cfg:
        kwargs["partition"] = cfg["partition"]
    return AsyncPipelineStrategy(schedule=cfg.get("schedule", "2bw"), num_microbatches=cfg.get("microbatches", 4),
                                 pipeline_timeout=cfg.get("timeout", 60.0), **kwargs)


class RecordedSummary(L.pytorch.callbacks.ModelSummary):
    """Lightning's model summary (cfg["summary"]), recording the total and each row's parameter count it prints."""

    def __init__(self) -> None:
        super().__init__(max_depth=1)
        self.recorded: dict = {}

    def summarize(self, summary_data, total_parameters, trainable_parameters, *args, **kwargs) -> None:
        rows = dict(summary_data)
        self.recorded = {"total": total_parameters, "trainable": trainable_parameters,
                         "rows": dict(zip(rows["Name"], (p.strip() for p in rows["Params"])))}


def build_trainer(cfg: dict, devices: int, strategy: bool = True) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks: list = []
    if cfg.get("summary"):
        callbacks.append(RecordedSummary())
    if cfg.get("save_every"):
        callbacks.append(ModelCheckpoint(dirpath=cfg["checkpoint_dir"], save_last=True,
                                         every_n_train_steps=cfg["save_every"]))
    kwargs = dict(
        accelerator="cpu", devices=devices, max_steps=cfg.get("steps", -1), max_epochs=cfg.get("max_epochs"),
        logger=False, enable_checkpointing=bool(callbacks), enable_progress_bar=False,
        callbacks=callbacks + freezing_callbacks(cfg.get("finetuning")), enable_model_summary=False,
        num_sanity_val_steps=cfg.get("sanity_steps", 0),
        limit_val_batches=cfg.get("val_batches", 1.0), limit_train_batches=cfg.get("limit_train_batches"),
        val_check_interval=cfg.get("val_every"), gradient_clip_val=cfg.get("clip"),
        gradient_clip_algorithm=cfg.get("clip_algorithm"),
    )
    if strategy:
        kwargs["strategy"] = build_strategy(cfg)
    if "precision" in cfg:
        kwargs["precision"] = cfg["precision"]
    if "use_distributed_sampler" in cfg:
        kwargs["use_distributed_sampler"] = cfg["use_distributed_sampler"]
    return L.Trainer(**kwargs)


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def held_dtypes(engine: Any, optimizers: list) -> dict[str, list[str]]:
    """The dtypes of what this process keeps per parameter: parameters, every weight-version slot (the newest and
    the stash) and each optimizer state tensor (the ErrorFeedback buffer among them)."""
    stages = engine.stages
    return {
        "params": sorted({str(p.dtype) for st in stages for p in st.params}),
        "slots": sorted({str(t.dtype) for st in stages for slot in st.versions.slots for t in slot}),
        "optimizer_state": sorted({f"{k}:{v.dtype}" for opt in optimizers for s in opt.state.values()
                                   for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0}),
    }


def run(cfg: dict, devices: int, strategy: bool = True) -> tuple[dict, PipelineModule, L.Trainer]:
    """fit (and the calls after it); returns what this rank saw, the model and the trainer."""
    if cfg.get("seed") is not None:
        L.seed_everything(cfg["seed"], verbose=False)
    model = build_model(cfg)
    loader = build_loader(cfg)
    if cfg.get("rng_per_rank"):
        # No seed: each process's global RNG is in its own state, as after seeding from the clock.
        torch.manual_seed(1000 + 17 * int(os.environ.get("LOCAL_RANK", 0)))
    trainer = build_trainer(cfg, devices, strategy)
    val_loader = build_loader(cfg, {"kind": "seq", "samples": 32, "batch": 16}) if "val_every" in cfg else None
    trainer.fit(model, loader, val_loader, ckpt_path=cfg.get("resume_from"))
    result: dict[str, Any] = {"rank": trainer.global_rank, "calls": model.calls, "seen_batches": model.seen_batches,
                              "global_step": trainer.global_step, "losses": model.losses,
                              "val_losses": model.val_losses, "metric_values": getattr(model, "metric_values", [])}
    engine = getattr(trainer.strategy, "engine", None)
    if engine is not None:
        result["dtypes"] = held_dtypes(engine, trainer.optimizers)
        times = engine.stats.last_times  # the last step's
        result["last_times"] = {**dataclasses.asdict(times), "idle": times.idle}
        result["run_ahead"] = engine.stats.split.run_ahead  # 2bw's last stage: None where no stage could
    if trainer.is_global_zero:
        result["state_dict"] = _cpu(model.state_dict())
        result["summary"] = next((c.recorded for c in trainer.callbacks if isinstance(c, RecordedSummary)), None)
        result["train_loss"] = _cpu(trainer.callback_metrics.get("train_loss"))
    for action in cfg.get("after", []):
        eval_loader = build_loader(cfg, cfg.get("eval_data", {"kind": "seq", "drop_last": False}))
        if action == "validate":
            result["validate"] = _cpu(trainer.validate(model, eval_loader, verbose=False))
            if trainer.is_global_zero:
                result["state_dict_after_validate"] = _cpu(model.state_dict())
        elif action == "test":
            result["test"] = _cpu(trainer.test(model, eval_loader, verbose=False))
        elif action == "predict":
            result["predict"] = _cpu(trainer.predict(model, eval_loader))
        else:
            raise ValueError(action)
    return result, model, trainer


def run_cases(cfg: dict, devices: int, strategy: bool = True) -> tuple[dict, PipelineModule, L.Trainer]:
    """``cfg["cases"]`` (name -> config) run one after another in the same processes (one launch for several
    runs); the result maps each name to what ``run`` returned. Without "cases": ``run(cfg)``."""
    if "cases" not in cfg:
        return run(cfg, devices, strategy)
    results: dict[str, Any] = {}
    for name, case in cfg["cases"].items():
        results[name], model, trainer = run(case, devices, strategy)
    return {"rank": trainer.global_rank, "cases": results}, model, trainer


def main() -> None:
    script_main(run_cases)


if __name__ == "__main__":
    main()
