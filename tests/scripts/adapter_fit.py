"""Trains a tiny ``models.HuggingFaceCausalLM`` or ``models.LitGPT`` with AsyncPipelineStrategy; every rank saves what
it saw to ``OUT/rank{r}.pt``.

Run by tests/test_adapters.py in a subprocess (Lightning's launcher re-executes this script for the other rank);
the tests also import ``build_model``/``run`` for the same run on one device in their own process.

Config keys: adapter ("hf" or "litgpt"), model (adapter config overrides), devices, stages (on one device),
schedule, microbatches, partition, steps, seed, samples, batch, seq, lr, checkpoint_dir (a sharded checkpoint at
the last step), after (trainer calls after fit in the same interpreter: "validate", "test", "predict", "fit"),
pretrained (a save_pretrained folder / litgpt checkpoint folder to start from), zero_lr_first (the first update
has learning rate 0; each rank then records its parameters after it as ``first_step`` and the first batch's loss as
``first_loss``), finetune (Lightning's BaseFinetuning freezes the embedding in setup and unfreezes it into a new
parameter group at epoch 1; each rank holding it records it then as ``frozen_embedding``), sgd (SGD over the
trainable parameters instead of the adapter's AdamW), strategy (False: plain Lightning, no strategy), packed (hf:
the same rows as packed batches {"input_ids", "position_ids"} of documents 1..7 tokens long, as llama_fit's, and
``skip_document_ends``).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import script_main  # noqa: E402
from llama_fit import packed_rows, token_rows  # noqa: E402  (the same counting rows, packed alike)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs are built here

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import HuggingFaceCausalLM, LitGPT  # noqa: E402

#: Tiny configs: 2 blocks, so that embedding | blocks | norm + head split into 2 stages in several ways.
HF_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
LITGPT_PYTHIA = dict(name="pythia-14m", n_layer=2, n_embd=32, n_head=4, vocab_size=256, block_size=64)


def build_model(cfg: dict) -> L.LightningModule:
    model = _build_model(cfg)
    if cfg.get("sgd"):  # plain SGD: the pipeline's and plain Lightning's rounding differ only by ~1e-7
        model.configure_optimizers = lambda: torch.optim.SGD(  # type: ignore[method-assign]
            [p for p in model.parameters() if p.requires_grad], lr=model.lr)
    return model


def _build_model(cfg: dict) -> L.LightningModule:
    lr = cfg.get("lr", 3e-3)  # as llama_fit; litgpt's key biases get only rounding noise as gradient, which Adam scales to ~lr
    hf = cfg.get("adapter", "hf") == "hf"
    if cfg.get("packed") and not hf:
        raise ValueError("packed: models.LitGPT takes token rows only")
    packed = {"skip_document_ends": True} if cfg.get("packed") else {}
    if cfg.get("pretrained"):
        if hf:
            return HuggingFaceCausalLM.from_pretrained(cfg["pretrained"], lr=lr, init_seed=cfg.get("seed", 0), **packed)
        return LitGPT.from_checkpoint(cfg["pretrained"], lr=lr, init_seed=cfg.get("seed", 0))
    if hf:
        return HuggingFaceCausalLM({**HF_LLAMA, **cfg.get("model", {})}, lr=lr, init_seed=cfg.get("seed", 0), **packed)
    return LitGPT({**LITGPT_PYTHIA, **cfg.get("model", {})}, lr=lr, init_seed=cfg.get("seed", 0))


def loader(cfg: dict) -> DataLoader:
    rows: Any = token_rows(cfg.get("samples", 32), cfg.get("seq", 16))
    if cfg.get("packed"):
        rows = packed_rows(rows)
    return DataLoader(rows, batch_size=cfg.get("batch", 8), shuffle=False, drop_last=True)


def run(cfg: dict, devices: int) -> tuple[dict, L.LightningModule, L.Trainer]:
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    model = build_model(cfg)
    trainer = make_trainer(cfg, devices)
    trainer.fit(model, loader(cfg))
    result: dict[str, Any] = {"rank": trainer.global_rank, "global_step": trainer.global_step,
                              "metrics": {k: v.item() for k, v in trainer.callback_metrics.items()}}
    if getattr(model, "_pretrained_tensors", None) is not None:
        result["keys_read"] = sorted(model._pretrained_tensors.keys_read)
    for callback in trainer.callbacks:
        if isinstance(callback, ZeroLrFirst):
            result.update(first_step=callback.first_step, first_loss=callback.first_loss)
        if isinstance(callback, FreezeEmbeddingUntilEpoch1) and callback.frozen is not None:
            result["frozen_embedding"] = callback.frozen
    if trainer.is_global_zero:
        result["state_dict"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for call in cfg.get("after", []):  # later calls in the same interpreter, each with a new Trainer
        trainer = make_trainer({**cfg, "evaluate": True}, devices)
        if call == "predict":
            outputs = trainer.predict(model, loader(cfg))
            result.setdefault("after", []).append(torch.cat(outputs) if outputs[0] is not None else None)
        elif call == "fit":
            trainer.fit(model, loader(cfg))
            if trainer.is_global_zero:
                result.setdefault("after", []).append({k: v.detach().cpu().clone() for k, v in model.state_dict().items()})
        else:
            result.setdefault("after", []).append(getattr(trainer, call)(model, loader(cfg), verbose=False)[0])
    return result, model, trainer


def make_trainer(cfg: dict, devices: int) -> L.Trainer:
    kwargs: dict[str, Any] = {}
    if cfg.get("partition"):
        kwargs["partition"] = cfg["partition"]
    if devices == 1:
        kwargs["num_stages"] = cfg.get("stages", 2)  # the one-device emulation of the same pipeline
    strategy: Any = "auto"  # strategy=False: plain Lightning
    if cfg.get("strategy", True):
        strategy = AsyncPipelineStrategy(schedule=cfg.get("schedule", "2bw"), num_microbatches=cfg.get("microbatches", 4),
                                         pipeline_timeout=60.0, **kwargs)
    callbacks: list[L.Callback] = [ZeroLrFirst()] if cfg.get("zero_lr_first") else []
    if cfg.get("checkpoint_dir"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=cfg["checkpoint_dir"], every_n_train_steps=cfg.get("steps", 4)))
    checkpointing = bool(cfg.get("checkpoint_dir"))  # else Lightning's default one would write ./checkpoints
    if cfg.get("finetune"):
        callbacks.append(FreezeEmbeddingUntilEpoch1())
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=cfg.get("steps", 4), logger=False,
        callbacks=callbacks, enable_checkpointing=checkpointing, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1 if cfg.get("evaluate") else 0,
    )
    return trainer


class FreezeEmbeddingUntilEpoch1(BaseFinetuning):
    """BaseFinetuning as Lightning's docs show it, on the adapter's own module path: the embedding frozen in setup
    (before configure_model), unfrozen into a new parameter group (half the configured rate) at epoch 1."""

    frozen: Any = None

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(self.embedding(pl_module))

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        if epoch == 1:
            weight = self.embedding(pl_module).weight
            if not weight.is_meta:  # this rank holds the embedding's stage
                self.frozen = weight.detach().clone()
            self.unfreeze_and_add_param_group(self.embedding(pl_module), optimizer, lr=pl_module.lr / 2)

    @staticmethod
    def embedding(pl_module: L.LightningModule) -> torch.nn.Module:
        return pl_module.model.embed_tokens if isinstance(pl_module, HuggingFaceCausalLM) else pl_module.transformer.wte


class ZeroLrFirst(L.Callback):
    """The first update has learning rate 0 (the later ones the configured rate); records this rank's parameters
    (its own stage's) after that update, and the first batch's loss."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if not hasattr(self, "configured"):
            self.configured = [[g["lr"] for g in o.param_groups] for o in trainer.optimizers]
        for optimizer, rates in zip(trainer.optimizers, self.configured):
            for group, lr in zip(optimizer.param_groups, rates):
                group["lr"] = 0.0 if trainer.global_step == 0 else lr

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 1 and not hasattr(self, "first_step"):
            self.first_step = {k: v.detach().clone() for k, v in pl_module.state_dict().items() if not v.is_meta}
            self.first_loss = outputs["loss"].detach().clone()


def main() -> None:
    script_main(run)


if __name__ == "__main__":
    main()
