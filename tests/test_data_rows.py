"""The rows a data module declares (``block_size``, ``document_mask``) are checked against the model at the
strategy's setup, before any training step, and a refusal names the config key to change
(``lightning_async_pp/strategy/data_rows.py``); after a setup that failed, the teardown leaves the error as the
call's and the model as setup found it. The multi-process cases (packed rows refused under tensor parallelism, the
teardown of meta DTensors) run in tests/test_tensor_parallel.py's checkpoint launch."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from helpers import one_device_trainer
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from llama_fit import packed_rows, token_rows  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.models import GPT, Llama  # noqa: E402
from lightning_async_pp.strategy.data_rows import check_rows  # noqa: E402


class TokenRows(L.LightningDataModule):
    """Rows of ``block_size + 1`` token ids, packed with positions under ``document_mask`` (as
    ``data.TextDataModule`` makes them)."""

    def __init__(self, block_size: int, document_mask: bool = False) -> None:
        super().__init__()
        self.block_size, self.document_mask = block_size, document_mask

    def train_dataloader(self) -> DataLoader:
        rows = token_rows(16, self.block_size)
        return DataLoader(packed_rows(rows) if self.document_mask else rows, batch_size=4)


class CountingBatches(L.Callback):
    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, *args) -> None:
        self.started += 1


def test_rows_longer_than_the_models_positions_are_refused_at_setup_naming_the_config_key():
    """Before: a warning at setup ("could not cost the layers") and the refusal at the first batch, after the
    start-up. Now: refused by the strategy's setup, before the split is costed and before any batch."""
    model = Llama("tiny", vocab_size=256, max_seq_len=32)
    counting = CountingBatches()
    trainer = one_device_trainer(AsyncPipelineStrategy(num_stages=2, num_microbatches=2), steps=1,
                                 callbacks=[counting])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"TokenRows has block_size=64, rows longer than the 32 positions "
                                             r"Llama takes: set data\.block_size: 32 \(or less\) in the config"):
            trainer.fit(model, datamodule=TokenRows(block_size=64))
    assert counting.started == 0 and trainer.global_step == 0
    assert not any("could not cost" in str(w.message) for w in caught)  # refused before the split is costed
    # GPT's positions (its block_size hyperparameter), and a row within them passes
    gpt = GPT(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(ValueError, match=r"block_size=17, .* the 16 positions GPT takes: set data\.block_size: 16"):
        check_rows(TokenRows(block_size=17), gpt)
    check_rows(TokenRows(block_size=16), gpt)
    check_rows(None, gpt)  # no data module: nothing to check


@pytest.fixture
def two_rank_mesh():
    """Rank 0 of a fake 2-process group in this process (torch's test backend: collectives do nothing) and a mesh
    named as the strategy's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("data_parallel", "pipeline", "tensor_parallel"))
    dist.destroy_process_group()


def tensor_parallel_llama(mesh) -> Llama:
    """``models.Llama`` as the strategy builds it at t = 2: layers on the meta device, the plan applied."""
    from lightning_async_pp.parallel.placement import parameters_on_meta

    model = Llama("tiny", vocab_size=256, max_seq_len=64)
    model._device_mesh = mesh  # what the strategy sets (strategy/_lightning.set_device_mesh)
    with parameters_on_meta():
        model.configure_model()
    return model


def test_rows_the_sequence_split_cannot_take_packed_or_not_are_refused_under_tensor_parallelism_naming_the_key(
        two_rank_mesh):
    model = tensor_parallel_llama(two_rank_mesh)
    check_rows(TokenRows(block_size=16), model)  # token rows of an even length: taken
    check_rows(TokenRows(block_size=16, document_mask=True), model)  # packed ones too
    for document_mask in (False, True):
        with pytest.raises(ValueError, match=r"splits each row's 15 input tokens over the tensor-parallel ranks.* "
                                             r"Change data\.block_size \(now 15\) in the config"):
            check_rows(TokenRows(block_size=15, document_mask=document_mask), model)


def test_meta_tensors_are_set_aside_while_the_module_moves_and_back_afterwards_dtensors_included(two_rank_mesh):
    """What the strategy's teardown does after a setup that failed before materializing: Lightning moves the module
    to the CPU, which a meta tensor cannot be copied out of ("Cannot copy out of meta tensor"), and a DTensor one
    could not be swapped with a plain placeholder ("different slots")."""
    from torch.distributed.tensor import DTensor

    from lightning_async_pp.parallel.tensor_parallel import meta_tensors_set_aside

    model = tensor_parallel_llama(two_rank_mesh)
    params = dict(model.named_parameters())
    assert any(isinstance(p, DTensor) for p in params.values()) and all(p.is_meta for p in params.values())
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        torch.nn.Linear(2, 2, device="meta").cpu()
    with meta_tensors_set_aside(model):
        assert not any(p.is_meta for p in model.parameters())
        model.cpu()
    # the same parameter objects, meta again (a later setup materializes them), tied ones still one
    assert dict(model.named_parameters()) == params and all(p.is_meta for p in model.parameters())
    assert all(type(p) is type(params[n]) for n, p in model.named_parameters())


def test_an_error_in_the_teardown_of_a_failed_call_is_printed_not_raised_over_the_calls_own_error(monkeypatch, capsys):
    from lightning.pytorch.strategies import DDPStrategy

    def broken(self):
        raise RuntimeError("the teardown broke")

    monkeypatch.setattr(DDPStrategy, "teardown", broken)
    trainer = one_device_trainer(AsyncPipelineStrategy(num_stages=2, num_microbatches=2), steps=1)
    with pytest.raises(ValueError, match=r"set data\.block_size: 32"):
        trainer.fit(Llama("tiny", vocab_size=256, max_seq_len=32), datamodule=TokenRows(block_size=64))
    assert ("lightning_async_pp: tearing down after the failure also raised RuntimeError: the teardown broke; the "
            "failure is the call's error") in capsys.readouterr().err
    # where the call is not failing, the teardown's error is the call's
    trainer = one_device_trainer(AsyncPipelineStrategy(num_stages=2, num_microbatches=2), steps=1)
    with pytest.raises(RuntimeError, match="the teardown broke"):
        trainer.fit(Llama("tiny", vocab_size=256, max_seq_len=32), datamodule=TokenRows(block_size=32))
