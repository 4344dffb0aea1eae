"""``LightningModule.strict_loading`` when resuming: as in plain Lightning, ``False`` loads a checkpoint that lacks
some of the module's keys (they keep their values) or holds keys the module does not have (ignored); ``True``
refuses both. Compared with plain Lightning resuming its own checkpoint of the same run (one device)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from helpers import one_device_trainer  # noqa: E402
from seam_fit import SeamTinyLM, build_loader  # noqa: E402
from test_lightning_seam import max_difference, state  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402

DATA = dict(data={"samples": 32, "batch": 8})  # 4 batches per epoch: saved at the end of the first


def unmarked(strict: bool = True) -> SeamTinyLM:
    model = SeamTinyLM(optimizer="adamw")
    model.strict_loading = strict
    return model


def marked(strict: bool = True) -> SeamTinyLM:
    """The model with one more buffer in its last layer (``layers.3.marker``)."""
    model = unmarked(strict)
    model.layers[-1].register_buffer("marker", torch.full((1,), 7.0))
    return model


def strategy() -> AsyncPipelineStrategy:
    return AsyncPipelineStrategy("1f1b", num_microbatches=4, num_stages=2)


def save(model, directory: Path, pipeline: bool) -> Path:
    checkpoint = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=4)
    one_device_trainer(strategy() if pipeline else None, steps=4, enable_checkpointing=True,
                       callbacks=[checkpoint]).fit(model, build_loader(DATA))
    return directory / "last.ckpt"


def resume(model, checkpoint: Path, pipeline: bool) -> dict:
    one_device_trainer(strategy() if pipeline else None, steps=6).fit(model, build_loader(DATA), ckpt_path=checkpoint)
    return state(model)


@pytest.mark.parametrize("saved_with_marker", [False, True],
                         ids=["checkpoint_lacks_a_key", "checkpoint_has_an_extra_key"])
def test_strict_loading_false_resumes_as_plain_lightning_and_true_refuses(tmp_path, saved_with_marker):
    saved, loading = (marked, unmarked) if saved_with_marker else (unmarked, marked)
    ours_ckpt, plain_ckpt = save(saved(), tmp_path / "ours", True), save(saved(), tmp_path / "plain", False)
    ours = resume(loading(False), ours_ckpt, True)
    plain = resume(loading(False), plain_ckpt, False)
    assert max_difference(ours, plain) < 1e-6
    start = state(loading())
    assert max_difference(ours, start) > 1e-3  # it trained on
    if not saved_with_marker:
        assert ours["layers.3.marker"].item() == 7.0  # a missing key keeps the module's value
    with pytest.raises(RuntimeError, match="marker"):
        resume(loading(True), plain_ckpt, False)  # plain Lightning refuses under strict_loading=True ...
    with pytest.raises(ValueError, match="marker"):
        resume(loading(True), ours_ckpt, True)  # ... and so does the strategy, naming the key
