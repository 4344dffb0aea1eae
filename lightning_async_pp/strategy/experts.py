"""What ``AsyncPipelineStrategy`` refuses at setup with ``expert_parallel_size > 1`` because it needs the trainer or
the model to see (the options alone are refused by ``PipelineConfig``): each refusal names the setting and what to
use instead. See docs/design/expert-parallel.md, "What runs"."""
from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from lightning_async_pp.pipeline.config import PipelineConfig
from lightning_async_pp.parallel.expert import LocalExperts
from lightning_async_pp.strategy.options import GATHERED


def refuse_with_expert_parallelism_at_setup(trainer: Any, module: Any, config: PipelineConfig) -> None:
    e = config.expert_parallel_size
    if e == 1:
        return
    refused = []
    if not any(isinstance(m, LocalExperts) for m in module.modules()):
        refused.append((f"the model {type(module).__name__}", "it holds no experts (no LocalExperts after "
                        "configure_model); models.Llama(num_experts=...) has them, or use expert_parallel_size=1"))
    if getattr(module, GATHERED, False):
        # rank 0's module holds every expert and stage, the other ranks their own: the processes disagree
        refused.append(("a trainer call on a model gathered by an earlier one (gather_final_weights=True)",
                        "pass gather_final_weights=False to the earlier Trainer, or build the model again and load "
                        "the gathered weights"))
    if trainer.state.fn == TrainerFn.PREDICTING:
        # Lightning's predict sampler gives the replicas unequal numbers of batches; the all-to-all of an expert
        # group needs every replica at every batch
        refused.append(("trainer.predict", "predict with expert_parallel_size=1"))
    if refused:
        what, instead = refused[0]
        raise ValueError(f"{what} is not supported with expert_parallel_size > 1 yet (expert_parallel_size={e}); "
                         f"{instead}")
