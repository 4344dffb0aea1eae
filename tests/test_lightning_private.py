"""Each Lightning behaviour without a public API that lightning_async_pp/strategy/_lightning.py relies on.

These fail loudly when a Lightning release changes one of them; the tested range is pinned in pyproject.toml.
"""
from __future__ import annotations

import inspect

import lightning as L
import pytest
import torch
from helpers import TinyLM, make_dataset
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from torch.utils.data import DataLoader, SequentialSampler

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.strategy import _lightning


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def test_every_loop_runs_on_before_batch_transfer_through_the_private_module_method():
    calls = []

    class Recording(TinyLM):
        def _on_before_batch_transfer(self, batch, dataloader_idx=0):
            calls.append(dataloader_idx)
            return super()._on_before_batch_transfer(batch, dataloader_idx)

    assert hasattr(L.LightningModule, _lightning.BEFORE_BATCH_TRANSFER)
    model = Recording()
    trainer = _trainer()
    loader = DataLoader(make_dataset(32), batch_size=8)
    trainer.fit(model, loader)
    assert len(calls) == 3  # one per training batch
    trainer.validate(model, loader)
    trainer.predict(model, loader)
    assert len(calls) == 3 + 4 + 4


def test_use_distributed_sampler_flag_decides_whether_a_ddp_strategy_replaces_the_sampler():
    trainer = _trainer(strategy=AsyncPipelineStrategy("1f1b", num_microbatches=4))
    assert hasattr(trainer._accelerator_connector, "use_distributed_sampler")
    trainer.fit(TinyLM(), DataLoader(make_dataset(32), batch_size=8, shuffle=False))
    assert isinstance(trainer.train_dataloader.sampler, SequentialSampler)  # the user's, kept


def test_training_step_starts_with_the_sigterm_broadcast_that_the_strategy_replaces():
    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)

    class Loop:  # replace_sigterm_broadcast writes the attribute the loop calls
        pass

    class Fit:
        epoch_loop = Loop()

    class FakeTrainer:
        fit_loop = Fit()

    marker = lambda: None  # noqa: E731
    _lightning.replace_sigterm_broadcast(FakeTrainer, marker)
    assert FakeTrainer.fit_loop.epoch_loop._broadcast_sigterm_tensor is marker


def test_pipeline_module_lets_a_batch_fetched_ahead_pass_the_loops_transfer_call_and_runs_the_hook_otherwise():
    from lightning_async_pp.strategy.lookahead import FetchedBatch

    class Halving(TinyLM):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return [batch[0], batch[1] / 2]

    model = Halving()
    fetched = FetchedBatch([1, 2])
    assert model._on_before_batch_transfer(fetched) is fetched  # the strategy transfers it, once
    x, y = torch.ones(2, 4), torch.full((2, 1), 4.0)
    assert torch.equal(_lightning.before_batch_transfer(model, [x, y])[1], y / 2)
    assert torch.equal(model._on_before_batch_transfer([x, y])[1], y / 2)


def test_a_checkpoint_saved_by_model_checkpoint_counts_its_trained_batches_and_configure_optimizers_reads_again(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    trainer = L.Trainer(max_steps=5, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, accelerator="cpu", devices=1, limit_val_batches=0,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)])
    trainer.fit(model)
    checkpoint = torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)  # saved in on_train_batch_end
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 3
    assert _lightning.batches_trained(checkpoint) == 3
    optimizers = _lightning.configure_optimizers(model)
    assert len(optimizers) == 1 and isinstance(optimizers[0], torch.optim.Optimizer)
    assert [p for g in optimizers[0].param_groups for p in g["params"]] == list(model.parameters())


def test_the_module_contract_does_not_import_the_strategy():
    # strategy/adapter.py imports module.py; module.py asks the strategy a question (resumes_pipeline_checkpoints)
    # instead. From the seam's folder module.py takes only the private touches of _lightning.py (its batch-transfer
    # pass-through), which imports nothing of the strategy, through the folder's __init__, which imports the
    # strategy's class only when the name is asked for.
    import ast
    from pathlib import Path

    import lightning_async_pp.module as module
    import lightning_async_pp.strategy as seam

    def imported(path, top_level_only=False):
        tree = ast.parse(Path(path).read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        nodes = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
        if top_level_only:  # an `if TYPE_CHECKING:` block is not run
            nodes += [m for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                      for m in n.orelse if isinstance(m, (ast.Import, ast.ImportFrom))]
        return {n.module for n in nodes if isinstance(n, ast.ImportFrom)} | {
            a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}

    names = imported(module.__file__)
    assert not any(name and "strategy" in name and name != "lightning_async_pp.strategy._lightning"
                   for name in names), names
    touches = imported(_lightning.__file__)
    assert not any(name and name.startswith("lightning_async_pp") and name != "lightning_async_pp.strategy.lookahead"
                   for name in touches), touches
    lookahead = Path(seam.__file__).with_name("lookahead.py")
    assert not any(name and name.startswith("lightning_async_pp") for name in imported(lookahead)), imported(lookahead)
    assert not any(name and name.startswith("lightning_async_pp") for name in imported(seam.__file__, True))
    assert AsyncPipelineStrategy.resumes_pipeline_checkpoints is True


def test_the_seam_has_one_entry_point_and_the_strategy_keeps_its_registered_name_and_old_import_path():
    import subprocess
    import sys

    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_async_pp
    import lightning_async_pp.strategy as seam
    from lightning_async_pp.strategy import AsyncPipelineStrategy as via_seam
    from lightning_async_pp.strategy.adapter import AsyncPipelineStrategy as defined

    assert lightning_async_pp.AsyncPipelineStrategy is via_seam is defined is seam.AsyncPipelineStrategy
    assert seam.__all__ == ["AsyncPipelineStrategy"]
    assert StrategyRegistry["async_pipeline"]["strategy"] is defined
    # In a fresh interpreter, importing the package alone registers the name, as before the move.
    code = ("from lightning.pytorch.strategies import StrategyRegistry; import lightning_async_pp; "
            "assert StrategyRegistry['async_pipeline']['strategy'].__module__ == 'lightning_async_pp.strategy.adapter'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_slurm_requeue_handler_is_looked_up_on_the_signal_connector_after_the_strategy_is_set_up(monkeypatch):
    import signal

    from lightning.pytorch.plugins.environments import SLURMEnvironment

    for key in [k for k in __import__("os").environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    calls = []
    trainer = _trainer(plugins=[SLURMEnvironment(auto_requeue=True)])
    _lightning.replace_requeue_handler(trainer, lambda signum, frame: calls.append(signum))
    previous = signal.getsignal(signal.SIGUSR1)
    trainer._signal_connector.register_signal_handlers()
    try:
        signal.getsignal(signal.SIGUSR1)(signal.SIGUSR1, None)
    finally:
        trainer._signal_connector.teardown()
        signal.signal(signal.SIGUSR1, previous)
    assert calls == [signal.SIGUSR1]
    source = inspect.getsource(L.Trainer._run)  # the strategy's setup comes first, so it can replace the handler
    assert source.index("self.strategy.setup(self)") < source.index("self._signal_connector.register_signal_handlers()")


def test_the_hpc_checkpoint_path_counts_up_and_ignores_the_folder_of_partial_writes(tmp_path):
    from lightning_async_pp.checkpoint import PARTIAL_DIR

    trainer = _trainer(default_root_dir=str(tmp_path))
    assert _lightning.hpc_save_path(trainer) == str(tmp_path / "hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()  # a sharded checkpoint is a directory
    (tmp_path / PARTIAL_DIR / "hpc_ckpt_2.ckpt").mkdir(parents=True)  # a write that was killed
    assert _lightning.hpc_save_path(trainer) == str(tmp_path / "hpc_ckpt_2.ckpt")


def test_the_trainer_unwraps_torch_compile_into_compiled_steps_recorded_in_compiler_ctx():
    # undo_whole_model_compile reads _compiler_ctx, which from_compiled sets when the Trainer unwraps the
    # OptimizedModule (_maybe_unwrap_optimized, in every trainer entry point), and undoes it with to_uncompiled.
    from lightning.pytorch.utilities.compile import from_compiled

    assert "_maybe_unwrap_optimized(model)" in inspect.getsource(L.Trainer.fit)
    model = TinyLM()
    assert model._compiler_ctx is None and not _lightning.undo_whole_model_compile(model)
    unwrapped = from_compiled(torch.compile(model))
    assert unwrapped is model and model._compiler_ctx is not None
    assert getattr(model.training_step, "__func__", None) is not TinyLM.training_step  # dynamo's wrapper
    assert _lightning.undo_whole_model_compile(model)
    assert model._compiler_ctx is None
    for step in ("forward", "training_step", "validation_step", "test_step", "predict_step"):
        assert getattr(model, step).__func__ is getattr(TinyLM, step)


class RecordedSummary(L.pytorch.callbacks.ModelSummary):
    """Records the totals the summary prints."""

    def __init__(self) -> None:
        super().__init__(max_depth=1)
        self.totals: list[tuple[int, list[str]]] = []

    def summarize(self, summary_data, total_parameters, *args, **kwargs) -> None:
        self.totals.append((total_parameters, dict(summary_data)["Params"]))


def test_the_model_summary_is_taken_in_on_fit_start_inside_the_context_given_to_summarize_within():
    from contextlib import contextmanager

    from torch import nn

    model, entered = TinyLM(), []

    @contextmanager
    def with_an_extra_layer():  # stands in for the whole model assembled on a process that holds one stage
        entered.append(True)
        model.extra = nn.Linear(3, 5)  # 20 parameters
        try:
            yield
        finally:
            del model.extra

    summary = RecordedSummary()
    trainer = _trainer(callbacks=[summary])
    own = sum(p.numel() for p in model.parameters())
    for _ in range(2):  # a second fit wraps the hook again, without nesting
        _lightning.summarize_within(trainer, with_an_extra_layer)
        trainer.fit(model, DataLoader(make_dataset(32), batch_size=8))
    assert entered == [True, True]
    assert [total for total, _ in summary.totals] == [own + 20, own + 20]
    assert summary.totals[0][1][-1].strip() == "20"  # its own row


def test_rich_bar_titles_an_epoch_without_limit_epoch_n_not_epoch_n_of_minus_two():
    from lightning.pytorch.callbacks import RichProgressBar

    pytest.importorskip("rich")
    loader = DataLoader(make_dataset(32), batch_size=8)
    titles = {}
    for name, strategy, limits in [("plain", "auto", dict(max_steps=3)),
                                   ("pipeline", AsyncPipelineStrategy("2bw", num_microbatches=4), dict(max_steps=3)),
                                   ("epochs", AsyncPipelineStrategy("2bw", num_microbatches=4), dict(max_epochs=2))]:
        bar = RichProgressBar()
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, callbacks=[bar],
                            enable_model_summary=False, num_sanity_val_steps=0, strategy=strategy, **limits)
        trainer.fit(TinyLM(), loader)
        titles[name] = bar._get_train_description(0).rstrip()
    assert titles["plain"] == "Epoch 0/-2"  # Lightning's own title, which the strategy's replacement rewrites
    assert titles["pipeline"] == "Epoch 0" and titles["epochs"] == "Epoch 0/1"


def test_a_modules_device_mesh_is_the_attribute_the_strategy_sets():
    model = TinyLM()
    assert model.device_mesh is None
    mesh = object()
    _lightning.set_device_mesh(model, mesh)
    assert model.device_mesh is mesh
