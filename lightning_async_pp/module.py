"""``PipelineModule``: the model contract shared by ordinary Lightning training and the pipeline."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol

import lightning as L
import torch
from torch import Tensor, nn

from lightning_async_pp.parallel.tensor_parallel import whole_parameters
from lightning_async_pp.pipeline.microbatch import batch_size_of
from lightning_async_pp.strategy._lightning import PassesFetchedBatches


def layer_seed(index: int, base: Optional[int] = None) -> int:
    """The seed of pipeline layer ``index``'s initialization: from ``base`` (default ``torch.initial_seed()``, what
    ``seed_everything`` set) and the index only, so a layer's weights do not depend on which process builds it."""
    return ((torch.initial_seed() if base is None else base) * 1_000_003 + index) % 2**63


class PipelineExecutor(Protocol):
    """What a pipeline strategy plugs into a ``PipelineModule`` to replace the sequential run."""

    def train_loss(self, batch: Any, batch_idx: int) -> Tensor: ...  # forward and backward; the detached mean loss

    def train_metrics(self) -> dict[str, Tensor]: ...  # the last trained batch's pipeline_metrics(), on every rank

    def eval_loss(self, batch: Any) -> Tensor: ...  # forward only, newest weights, any batch size

    def predict(self, batch: Any) -> Any: ...  # the last layer's output, newest weights


class PipelineModule(PassesFetchedBatches, L.LightningModule):
    """A ``LightningModule`` described as an ordered list of layers and a loss.

    Subclasses implement :meth:`pipeline_layers` and :meth:`pipeline_loss` (and optionally
    :meth:`pipeline_input`). The ``training_step``/``validation_step``/``test_step`` supplied here run the
    layers in order, so the same module trains under any Lightning strategy; ``AsyncPipelineStrategy``
    replaces that sequential run by the pipeline.
    """

    #: Set by a pipeline strategy while it drives this module; ``None`` means "run the layers in order here".
    _pipeline_executor: Optional[PipelineExecutor] = None

    # ---- the contract ------------------------------------------------------------------------------------
    def pipeline_layers(self) -> Sequence[nn.Module]:
        """The layers in order; each takes the previous layer's output (a tensor or a tuple of tensors)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_layers()")

    def pipeline_loss(self, output: Any, batch: Any) -> Tensor:
        """The mean loss of the last layer's ``output`` for ``batch`` (a microbatch under the pipeline)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_loss(output, batch)")

    def pipeline_loss_weight(self, batch: Any) -> Any:
        """How much a microbatch's mean loss weighs in its batch's mean: a number or a scalar tensor. The pipeline
        takes the batch loss (and so its gradient) as ``sum_j w_j loss_j / sum_j w_j`` over the batch's microbatches,
        evaluation too. Default: the microbatch's rows, which makes equal microbatches the mean of their means (the
        whole batch's mean for a loss that averages over rows). A loss that averages over a varying number of
        targets per row (skipped targets) returns that number, so the batch loss is the mean over all its targets,
        as the batch in one piece gives it, whatever the microbatch count (docs/design/update-rule.md)."""
        return batch_size_of(batch)

    def pipeline_input(self, batch: Any) -> Any:
        """What the first layer takes. Default: the batch itself if it is a tensor, its first element if it is
        a tuple or list, its ``"input"``/``"inputs"`` entry if it is a mapping."""
        if isinstance(batch, Tensor):
            return batch
        if isinstance(batch, (tuple, list)) and batch:
            return batch[0]
        if isinstance(batch, Mapping):
            for key in ("input", "inputs", "input_ids", "x"):
                if key in batch:
                    return batch[key]
        raise TypeError(
            f"Cannot tell the inputs of a batch of type {type(batch).__name__}; override pipeline_input(batch)"
        )

    #: An example batch of one microbatch's shape that ``partition="balanced"`` costs the layers on (shapes only:
    #: it runs on the ``meta`` device). ``None``: :meth:`pipeline_sample` uses ``example_input_array``. The CLI sets
    #: it from the data module (``TextDataModule.example_batch()``).
    pipeline_example_batch: Any = None

    def pipeline_sample(self) -> Any:
        """One microbatch-shaped batch for the cost model of ``partition="balanced"`` (docs/design/planner.md, "Balanced
        split"), or ``None`` (then the split falls back to parameter counts, with a warning). Default:
        :attr:`pipeline_example_batch`, else ``example_input_array``."""
        if self.pipeline_example_batch is not None:
            return self.pipeline_example_batch
        return self.example_input_array

    def pipeline_metric_names(self) -> tuple[str, ...]:
        """Names of scalars, besides the loss, that ``pipeline_loss`` computes and ``training_step`` logs (an MoE
        model's balancing loss, say). Fixed for the module's lifetime; default none."""
        return ()

    def pipeline_metrics(self) -> dict[str, Tensor]:
        """The values of :meth:`pipeline_metric_names` for the batch just trained: called once per training batch after
        its last ``pipeline_loss`` (under the pipeline on the process holding the last stage, whose values then
        travel with the loss to every rank, data-parallel mean included). Also called, its values dropped, when
        2BW ran the next batch's first ``pipeline_loss`` ahead and Lightning then did not train that batch (an epoch
        cut short, training stopped): what the module recorded for it must not count in a later batch."""
        return {}

    @torch.no_grad()
    def init_layer(self, index: int, layer: nn.Module) -> None:
        """Initialize pipeline layer ``index`` after a pipeline strategy gave it memory (it was built on the meta
        device in ``configure_model``). Called only on the process that runs the layer.

        Default: ``reset_parameters()`` of each of its submodules that holds parameters (and of those holding
        only buffers, where they have one), drawing from the global RNG seeded from ``torch.initial_seed()`` and
        ``index`` (the global RNG is left as it was), so a layer's weights do not depend on which other layers a
        process builds. Buffers computed in ``__init__`` keep their values (the strategy builds only parameters on
        the meta device). Override it for a custom initialization. A layer sharded by a tensor-parallel plan is
        initialized whole and each rank keeps its slice, so its values are one device's.
        """
        seed = layer_seed(index)
        devices = [p.device for p in layer.parameters() if p.device.type == "cuda"][:1]
        with torch.random.fork_rng(devices=devices), whole_parameters(layer):
            torch.manual_seed(seed)
            for module in layer.modules():
                reset = getattr(module, "reset_parameters", None)
                has_params = any(True for _ in module.parameters(recurse=False))
                if not has_params and not (callable(reset) and any(True for _ in module.buffers(recurse=False))):
                    continue
                if not callable(reset):
                    raise TypeError(
                        f"pipeline layer {index} was built on the meta device and its submodule "
                        f"{type(module).__name__} has no reset_parameters() to initialize it; define one, or override "
                        f"{type(self).__name__}.init_layer(index, layer)"
                    )
                reset()

    # ---- sequential run (what the pipeline reproduces) ---------------------------------------------------------
    def pipeline_forward(self, batch: Any) -> Any:
        """Run every layer in order on ``batch``'s inputs."""
        x = self.pipeline_input(batch)
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def forward(self, batch: Any) -> Any:
        return self.pipeline_forward(batch)

    def _loss(self, batch: Any, batch_idx: Optional[int] = None) -> Tensor:
        """Training loss when ``batch_idx`` is given (forward and backward under the pipeline), else evaluation."""
        executor = self._pipeline_executor
        if executor is None:
            return self.pipeline_loss(self.pipeline_forward(batch), batch)
        return executor.train_loss(batch, batch_idx) if batch_idx is not None else executor.eval_loss(batch)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint of ``AsyncPipelineStrategy`` resumes training only under that strategy (its optimizer states
        are saved by parameter name, for any layout); its ``state_dict`` alone loads anywhere
        (``load_from_checkpoint`` works)."""
        trainer = self._trainer
        if "async_pipeline" not in checkpoint or trainer is None or getattr(trainer.state, "fn", None) != "fit":
            return
        # Asked of the strategy instead of importing it: the strategy imports this module.
        if not getattr(trainer.strategy, "resumes_pipeline_checkpoints", False):
            raise ValueError(
                f"this checkpoint was saved by AsyncPipelineStrategy ({checkpoint['async_pipeline'].get('num_stages')} "
                f"pipeline stage(s)); its optimizer states are saved by parameter name, so resume it with "
                f"AsyncPipelineStrategy (any number of stages), or load only the weights: "
                f"model.load_state_dict(torch.load(path, weights_only=True)['state_dict'])"
            )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch, batch_idx)
        # Under the pipeline every rank already holds the data-parallel mean, so no sync here (a per-step
        # collective across stages would put a barrier back into a schedule built to avoid one).
        self.log("train_loss", loss, prog_bar=True)
        if self.pipeline_metric_names():
            executor = self._pipeline_executor
            metrics = self.pipeline_metrics() if executor is None else executor.train_metrics()
            for name, value in metrics.items():
                self.log(name, value)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """The last layer's output for ``batch`` (under the pipeline: on the first stage of each pipeline, ``None``
        on the others)."""
        executor = self._pipeline_executor
        if executor is None:
            return self.pipeline_forward(batch)
        return executor.predict(batch)
