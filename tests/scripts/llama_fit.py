"""Trains ``models.Llama`` (tiny) with AsyncPipelineStrategy; every rank saves what it saw to ``OUT/rank{r}.pt``.

Run by tests/test_llama_pipeline.py in a subprocess (Lightning's launcher re-executes this script for the other
ranks); the tests also import ``run`` to make the same run on one device in their own process.

Config keys: devices, stages (on one device), schedule, microbatches, partition, steps, tie, max_seq_len, vocab, seed,
samples, batch, seq,
val_every + val_batches (validation during fit), text_samples (TextSamples keyword arguments),
log_dir (a TensorBoardLogger there), timeout, clip (Trainer's gradient_clip_val), strategy_kwargs (more
AsyncPipelineStrategy arguments),
packed (rows as packed batches {"input_ids", "position_ids"} of documents 1..7 tokens long, ``skip_document_ends``),
eval_batch (the batch size of the non-fit calls of a sequence, last batch ragged),
activation_checkpointing, stage_memory_gib (strategy options as named), pool_buffers (receive buffers pooled as on
CUDA: ``StageLink.REUSE_BUFFERS_ON_CPU``),
cases: {name: config}: several runs in one launch (``run_cases``), each result under its name.
tensor_parallel (tensor_parallel_size; the weights are not gathered: every rank returns its stage's parameters
whole as "stage_weights", each DTensor's shards gathered over its tensor-parallel group, and its own shards as
"local_weights"), optimizer ("muon": optim.Muon over the named parameters, "error_feedback_muon": the same inside
ErrorFeedback; default the model's AdamW), swap_shards (a control: the model takes each sharded matrix's
neighbouring tensor-parallel rank's slice at initialization).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import Llama  # noqa: E402


def packed_rows(rows: list[torch.Tensor], seed: int = 4) -> list[dict[str, torch.Tensor]]:
    """The rows as packed samples: documents of 1..7 tokens, positions restarting at each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in rows:
        pos, filled = [], 0
        while filled < len(row):
            n = min(int(torch.randint(1, 8, (1,), generator=g)), len(row) - filled)
            pos.extend(range(n))
            filled += n
        out.append({"input_ids": row, "position_ids": torch.tensor(pos)})
    return out


def token_rows(samples: int, seq: int, seed: int = 3) -> list[torch.Tensor]:
    """Rows of ``seq + 1`` byte ids with structure a tiny model picks up in a few steps (counting sequences)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 256, (samples, 1), generator=g)
    steps = torch.randint(1, 4, (samples, 1), generator=g)
    return list((starts + steps * torch.arange(seq + 1)) % 256)


class LlamaGroupedByName(Llama):
    """Parameter groups chosen by name, as users write them: the embedding (and so the head tied to it) at a
    tenth of the learning rate; ``rank_dependent_lr`` makes the group differ between processes."""

    def __init__(self, *args: Any, rank_dependent_lr: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank_dependent_lr = rank_dependent_lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        named = list(self.named_parameters())
        slow = 0.1 * (1 + self.global_rank if self.rank_dependent_lr else 1)
        return torch.optim.AdamW([
            {"params": [p for n, p in named if n.startswith("embed.")], "lr": self.hparams.lr * slow},
            {"params": [p for n, p in named if not n.startswith("embed.")]},
        ], lr=self.hparams.lr)


class LlamaSwappedShards(Llama):
    """A wrong shard (the control of the tensor-parallel tests): each sharded matrix starts from the slice of the
    neighbouring tensor-parallel rank instead of its own."""

    @torch.no_grad()
    def init_layer(self, index: int, layer: torch.nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        super().init_layer(index, layer)
        for p in layer.parameters():
            if isinstance(p, DTensor):
                local = p.to_local()
                t = p.device_mesh.size()
                rank = p.device_mesh.get_local_rank()
                full = p.full_tensor()
                dim = p.placements[0].dim
                local.copy_(full.chunk(t, dim=dim)[(rank + 1) % t])


def muon_optimizer(model: Llama, kind: str) -> torch.optim.Optimizer:
    """``optim.Muon`` over the model's named parameters (the blocks' matrices to Muon, embedding, head and norms to
    its AdamW), alone or inside ``ErrorFeedback``."""
    from functools import partial

    from lightning_async_pp.optim import ErrorFeedback, Muon

    make = partial(Muon, lr=model.hparams.lr, weight_decay=0.1)
    if kind == "muon":
        return make(model.named_parameters())
    assert kind == "error_feedback_muon", kind
    return ErrorFeedback(model.named_parameters(), optimizer=make)


def build(cfg: dict) -> tuple[Llama, DataLoader, L.Trainer]:
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    tie = cfg.get("tie", True)
    if cfg.get("untie_on_other_ranks") and os.environ.get("LOCAL_RANK", "0") != "0":
        tie = not tie  # a model that differs between processes (the launcher sets LOCAL_RANK for rank 1)
    kwargs: dict[str, Any] = {}
    if cfg.get("groups_by_name"):
        kwargs["rank_dependent_lr"] = cfg["groups_by_name"] == "rank_dependent"
    model = (LlamaGroupedByName if cfg.get("groups_by_name") else LlamaSwappedShards if cfg.get("swap_shards") else Llama)(
        "tiny", vocab_size=cfg.get("vocab", 256), tie_embeddings=tie, max_seq_len=cfg.get("max_seq_len", 64),
        lr=cfg.get("lr", 3e-3), skip_document_ends=bool(cfg.get("packed")), **kwargs)
    if cfg.get("optimizer"):
        model.configure_optimizers = lambda: muon_optimizer(model, cfg["optimizer"])  # type: ignore[method-assign]
    rows: Any = token_rows(cfg.get("samples", 32), cfg.get("seq", 16))
    if cfg.get("packed"):
        rows = packed_rows(rows)
    loader = DataLoader(rows, batch_size=cfg.get("batch", 8), shuffle=False, drop_last=True)
    return model, loader, make_trainer(cfg)


def make_trainer(cfg: dict) -> L.Trainer:
    kwargs: dict[str, Any] = {}
    if cfg.get("partition"):
        kwargs["partition"] = cfg["partition"]
    if cfg.get("devices", 2) == 1:
        kwargs["num_stages"] = cfg.get("stages", 2)  # the one-device emulation of the same pipeline
    if cfg.get("tensor_parallel"):
        kwargs.update(tensor_parallel_size=cfg["tensor_parallel"], gather_final_weights=False)
    for key in ("activation_checkpointing", "stage_memory_gib"):
        if cfg.get(key) is not None:
            kwargs[key] = cfg[key]
    from lightning_async_pp.pipeline.comm import StageLink

    StageLink.REUSE_BUFFERS_ON_CPU = bool(cfg.get("pool_buffers"))  # what CUDA does; each case sets its own
    kwargs.update(cfg.get("strategy_kwargs", {}))
    strategy = AsyncPipelineStrategy(schedule=cfg.get("schedule", "2bw"), num_microbatches=cfg.get("microbatches", 4),
                                     pipeline_timeout=cfg.get("timeout", 60.0), **kwargs)
    callbacks = []
    if cfg.get("text_samples") is not None:
        from lightning_async_pp.callbacks import TextSamples

        callbacks.append(TextSamples(**cfg["text_samples"]))
    logger: Any = False
    if cfg.get("log_dir"):
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(cfg["log_dir"], name="", version=0)
    val_every = cfg.get("val_every")
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=cfg.get("devices", 2), max_steps=cfg.get("steps", 4),
        logger=logger, callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, gradient_clip_val=cfg.get("clip"),
        limit_val_batches=cfg.get("val_batches", 1) if val_every or cfg.get("sequence") else 0, val_check_interval=val_every,
    )
    return trainer


def run(cfg: dict, devices: int) -> tuple[dict, Llama, L.Trainer]:
    if cfg.get("sequence"):
        return run_sequence(cfg, devices)
    model, loader, trainer = build({**cfg, "devices": devices})
    trainer.fit(model, loader, loader if cfg.get("val_every") else None)
    result: dict[str, Any] = {"rank": trainer.global_rank, "global_step": trainer.global_step,
                              "split": (trainer.strategy.engine.stats.split.method,
                                        list(trainer.strategy.engine.stats.split.counts))}
    samples = [c for c in trainer.callbacks if type(c).__name__ == "TextSamples"]
    if samples:
        result["texts"] = samples[0].history
    if cfg.get("tensor_parallel") and devices > 1:
        result.update(stage_weights(model))
        if cfg.get("optimizer"):
            result["muon_step_difference"] = muon_step_against_whole(model)
    elif trainer.is_global_zero:
        result["state_dict"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return result, model, trainer


def stage_weights(model: Llama) -> dict[str, Any]:
    """This rank's stage's parameters whole (a DTensor's shards gathered over its tensor-parallel group: every rank
    of the stage calls this) and its own local tensors."""
    from torch.distributed.tensor import DTensor

    whole, local = {}, {}
    for name, p in model.named_parameters():
        p = p.detach()
        whole[name] = (p.full_tensor() if isinstance(p, DTensor) else p).cpu().clone()
        local[name] = (p.to_local() if isinstance(p, DTensor) else p).cpu().clone()
    return {"stage_weights": whole, "local_weights": local}


def muon_step_against_whole(model: Llama) -> float:
    """Two ``optim.Muon`` steps of each of this rank's sharded matrices (copies, from gradients equal on every rank)
    against the same steps of the whole matrix on this process alone: the largest difference of this rank's slice
    (0 when the tensor-parallel step is bitwise the one-device step)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from lightning_async_pp.optim import Muon

    worst, g = 0.0, torch.Generator().manual_seed(7)
    for p in model.parameters():
        if not isinstance(p, DTensor) or p.ndim != 2:
            continue
        mesh, placements = p.device_mesh, p.placements
        whole = torch.nn.Parameter(p.detach().full_tensor().cpu())
        sharded = torch.nn.Parameter(distribute_tensor(whole.detach().clone(), mesh, placements, src_data_rank=None))
        mine, reference = Muon([sharded], lr=0.01), Muon([whole], lr=0.01)
        for _ in range(2):
            grad = torch.randn(whole.shape, generator=g)
            whole.grad, sharded.grad = grad, distribute_tensor(grad.clone(), mesh, placements, src_data_rank=None)
            mine.step()
            reference.step()
        expected = distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None).to_local()
        worst = max(worst, float((sharded.detach().to_local() - expected).abs().max()))
    return worst


def run_sequence(cfg: dict, devices: int) -> tuple[dict, Llama, L.Trainer]:
    """Several trainer calls on one model in one interpreter, as a script or notebook makes them: ``sequence`` lists
    them ("fit", "validate", "test", "predict"; a "fit" after the first continues the weights with a new Trainer).
    With ``first_on_one_device`` the first call runs on one device before the others run on ``devices``. Records
    every loss, prediction and the weights after each call (rank 0's, gathered)."""
    model, loader, trainer = build({**cfg, "devices": 1 if cfg.get("first_on_one_device") else devices})
    eval_loader = loader
    if cfg.get("eval_batch"):  # a ragged last batch in evaluation and prediction
        eval_loader = DataLoader(loader.dataset, batch_size=cfg["eval_batch"], shuffle=False, drop_last=False)
    result: dict[str, Any] = {"calls": []}
    for i, call in enumerate(cfg["sequence"]):
        if i > 0:
            trainer = make_trainer({**cfg, "devices": devices})
        if call == "fit":
            trainer.fit(model, loader)
            record: Any = {"train_loss": float(trainer.callback_metrics["train_loss"])}
        elif call == "predict":
            outputs = trainer.predict(model, eval_loader)
            record = {"logits": torch.cat([o for o in outputs]) if outputs[0] is not None else None}
        else:
            metrics = getattr(trainer, call)(model, eval_loader, verbose=False)[0]
            record = {k: float(v) for k, v in metrics.items()}
        if trainer.is_global_zero:
            record["state_dict"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        result["calls"].append(record)
    result["rank"] = trainer.global_rank
    return result, model, trainer


def run_cases(cfg: dict, devices: int) -> tuple[dict, Llama, L.Trainer]:
    """``cfg["cases"]`` (name -> config) one after another in the same processes (one launch for several runs);
    the result maps each name to what ``run`` returned. Without "cases": ``run(cfg)``."""
    if "cases" not in cfg:
        return run(cfg, devices)
    results: dict[str, Any] = {}
    for name, case in cfg["cases"].items():
        results[name], model, trainer = run(case, devices)
    return {"rank": trainer.global_rank, "cases": results}, model, trainer


def main() -> None:
    script_main(run_cases)


if __name__ == "__main__":
    main()
