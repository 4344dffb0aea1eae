"""Trains ``models.Llama`` (tiny) with AsyncPipelineStrategy; every rank saves what it saw to ``OUT/rank{r}.pt``.

Run by tests/test_llama_pipeline.py in a subprocess (Lightning's launcher re-executes this script for the other
ranks); the tests also import ``run`` to make the same run on one device in their own process.

Config keys: devices, stages (on one device), schedule, microbatches, partition, steps, tie, max_seq_len, vocab, seed,
samples, batch, seq,
val_every + val_batches (validation during fit), text_samples (TextSamples keyword arguments),
log_dir (a TensorBoardLogger there), timeout, clip (Trainer's gradient_clip_val), strategy_kwargs (more
AsyncPipelineStrategy arguments),
packed (rows as packed batches {"input_ids", "position_ids"} of documents 1..7 tokens long, ``skip_document_ends``
unless skip_ends is False),
eval_batch (the batch size of the non-fit calls of a sequence, last batch ragged), record_state_bytes (each call of
a sequence records the optimizer state per layer its split counted),
activation_checkpointing, stage_memory_gib (strategy options as named), pool_buffers (receive buffers pooled as on
CUDA: ``StageLink.REUSE_BUFFERS_ON_CPU``),
compile_counted (compiled layers through a backend counting its graphs, aot_eager's: each rank returns the count
after each training batch as "graphs_per_batch"),
skew_times ({"tp_rank", "layer", "factor"}: with layer_cost="measured", that tensor-parallel rank's timing of that
layer multiplied by the factor; each rank returns what it timed as "own_times"),
cases: {name: config}: several runs in one launch (``run_cases``), each result under its name.
data_parallel (data_parallel_size r; ``batch`` and ``microbatches`` are a replica's: on one device each batch is the
r replicas' batches one after another, of ``r x microbatches`` microbatches, the run r replicas make; with
only_replica i, replica i's batches alone, what that replica would train without the reduction; replica_epoch:
the replicas' batches of that epoch, as their samplers shuffle it),
tensor_parallel (tensor_parallel_size; the weights are not gathered: every rank returns its stage's parameters
whole as "stage_weights", each DTensor's shards gathered over its tensor-parallel group, and its own shards as
"local_weights", and the shapes it sent or received across the stage boundary as "crossed"), swap_shards (a control: the model takes each sharded matrix's
neighbouring tensor-parallel rank's slice at initialization), unsummed (a control: the transformers plan's summed
parameters, Qwen3's q/k norms, left plain), model ("hf": a tiny transformers Llama,
``HF_LLAMA`` updated by ``hf_config``, or the config and weights of the save_pretrained folder ``pretrained``,
through models.HuggingFaceCausalLM; "own": ``OwnPlanLM``, a PipelineModule applying its own plan; "gpt":
a tiny models.GPT, untied; else models.Llama), optimizer ("muon": optim.Muon over the named parameters,
"error_feedback_muon": the same inside ErrorFeedback; "delay_compensation", "weight_prediction", "async_nesterov":
that correction over the model's AdamW groups; default the model's AdamW),
checkpoint_dir + save_at (a ModelCheckpoint writing checkpoint_dir/saved.ckpt at that step), save_after (a path:
``trainer.save_checkpoint`` there after fit), refused (a setup refused on purpose: the rows given through a
data module declaring them, ``RowsDataModule``; returns what fit raised, the batches started and whether every
parameter is still on the meta device), resume_from (ckpt_path),
resumable (a loader that resumes mid-epoch: tests/helpers.py ResumableLoader), gather (tensor_parallel with
gather_final_weights=True: rank 0 returns the whole "state_dict"), eval_calls (after fit, each of "validate", "test",
"predict" on a new Trainer; rank 0 returns their "eval" results), val_loss (returned when validation ran in fit),
monitors (StalenessMonitor and PipelineMonitor, with experts ExpertMonitor too, logging every step into a
``callback_fit.MemoryLogger``: rank 0
returns what they logged as "logged", every rank its stage's whole weights before training and after each step as
"weights_per_step"),
experts (models.Llama's routed-expert keyword arguments: num_experts, experts_per_token, ...), expert_parallel
(expert_parallel_size; unless gather, not gathered: every rank returns its stage's parameters as "stage_weights", its
experts under their global names), misroute_experts (a control: each held expert starts from the weights of the expert half the
experts away, so the tokens routed to it are computed by another; with model "hf", the held experts' weights
passed round among them), unaveraged_experts (a control: the expert
gradients are not divided by the number of replicas), optimizer "sgd" (plain SGD at ``lr``), count_expert_reads
(returns "expert_reads": the calls of run_experts during fit and the host reads, ``tolist``/``item``, issued by
parallel/expert.py's code, forward or backward).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import script_main  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp import PipelineModule  # noqa: E402
from lightning_async_pp.models import GPT, HuggingFaceCausalLM, Llama  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: configs are built here
#: DelayCompensation's coefficient in ``optimizer: "delay_compensation"``: large enough that the correction moves the
#: tiny model's weights far beyond the tensor-parallel tolerance in 3 steps (its gradients are small).
CORRECTION = 1e4
#: The tiny transformers Llama of ``model: "hf"`` (tests/scripts/adapter_fit.py's, with 4 blocks): the partition
#: [3, 4] splits it as embedding + 2 blocks | 2 blocks + norm + head.
HF_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


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


@torch.no_grad()
def swap_shards(layer: torch.nn.Module) -> None:
    """Each sharded matrix of ``layer`` takes the slice of the neighbouring tensor-parallel rank."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in layer.parameters():
            if isinstance(p, DTensor) and p.placements[0].is_shard():  # a replicated norm is whole on every rank
                t, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
                p.to_local().copy_(p.full_tensor().chunk(t, dim=p.placements[0].dim)[(rank + 1) % t])


class LlamaSwappedShards(Llama):
    """A wrong shard (the control of the tensor-parallel tests): each sharded matrix starts from the slice of the
    neighbouring tensor-parallel rank instead of its own."""

    def init_layer(self, index: int, layer: torch.nn.Module) -> None:
        super().init_layer(index, layer)
        swap_shards(layer)


class HFSwappedShards(HuggingFaceCausalLM):
    """``LlamaSwappedShards`` of the transformers adapter."""

    def init_layer(self, index: int, layer: torch.nn.Module) -> None:
        super().init_layer(index, layer)
        swap_shards(layer)


class HFUnsummed(HuggingFaceCausalLM):
    """A control: the plan's summed parameters (Qwen3's q/k norms) left plain, each rank stepping them with its
    own heads' part of the gradient."""

    def parallelize(self, tp_mesh: Any, plan: Any) -> None:
        import dataclasses

        super().parallelize(tp_mesh, dataclasses.replace(plan, summed=()))


class GPTSwappedShards(GPT):
    """``LlamaSwappedShards`` of ``models.GPT`` (built whole in ``__init__``: its plan lays out the values it has)."""

    def configure_model(self) -> None:
        super().configure_model()
        for layer in self.pipeline_layers():
            swap_shards(layer)


class LlamaMisroutedExperts(Llama):
    """The expert-parallel control: each held expert starts from the initial weights of the expert ``E / 2`` away,
    so the tokens the router sends to an expert are computed by another one."""

    def init_layer(self, index: int, layer: torch.nn.Module) -> None:
        import math

        from lightning_async_pp.models.routed_experts import init_experts
        from lightning_async_pp.module import layer_seed
        from lightning_async_pp.parallel.expert import LocalExperts

        super().init_layer(index, layer)
        for experts in [m for m in layer.modules() if isinstance(m, LocalExperts)]:
            moved = LocalExperts([])
            half = experts.num_experts // 2
            for key, expert in experts.items():
                moved[str((int(key) + half) % experts.num_experts)] = expert
            init_experts(moved, layer_seed(index, self.hparams.init_seed), 0.02,
                         0.02 / math.sqrt(2 * self.config.num_layers))


class HFMisroutedExperts(HuggingFaceCausalLM):
    """``LlamaMisroutedExperts`` of the transformers adapter: the experts this rank holds pass their initial weights
    round among themselves (expert 2r takes 2r + 1's, and so on), so tokens are computed by another expert."""

    def init_layer(self, index: int, layer: torch.nn.Module) -> None:
        from lightning_async_pp.parallel.expert import LocalExperts

        super().init_layer(index, layer)
        with torch.no_grad():
            for experts in [m for m in layer.modules() if isinstance(m, LocalExperts)]:
                held = list(experts.values())
                values = [[p.clone() for p in expert.parameters()] for expert in held]
                for i, expert in enumerate(held):
                    for p, v in zip(expert.parameters(), values[(i + 1) % len(held)]):
                        p.copy_(v)


class ResidualMLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.proj = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.norm(x))))


class OwnPlanLM(PipelineModule):
    """A user's own PipelineModule with its own tensor-parallel plan, as docs/guide/models.md ("Tensor parallelism
    in your own model") shows it: residual MLP blocks, ``fc`` column-wise and ``proj`` row-wise."""

    def __init__(self, vocab: int = 256, width: int = 32, layers: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.blocks: Any = None

    def configure_model(self) -> None:
        if self.blocks is not None:  # Lightning calls this hook on every trainer entry point
            return
        h = self.hparams
        self.embed = torch.nn.Embedding(h.vocab, h.width)
        self.blocks = torch.nn.ModuleList(ResidualMLP(h.width) for _ in range(h.layers))
        self.head = torch.nn.Sequential(torch.nn.LayerNorm(h.width), torch.nn.Linear(h.width, h.vocab))
        mesh = self.device_mesh  # set by AsyncPipelineStrategy(tensor_parallel_size > 1), as by ModelParallelStrategy
        if mesh is not None:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            for block in self.blocks:
                parallelize_module(block, mesh["tensor_parallel"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})

    def pipeline_layers(self) -> list[torch.nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def pipeline_input(self, batch: torch.Tensor) -> torch.Tensor:
        return batch[:, :-1]

    def pipeline_loss(self, logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class GraphsPerBatch(L.Callback):
    """A ``torch.compile`` backend (``backend``) that counts the graphs it compiles and runs them through
    ``aot_eager`` (AOTAutograd's forward and backward graphs, eager kernels), and the count after each training
    batch (``after_batch``)."""

    def __init__(self) -> None:
        self.graphs, self.after_batch = 0, []

    def backend(self, gm: Any, example_inputs: list) -> Any:
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def on_train_batch_end(self, *args: Any) -> None:
        self.after_batch.append(self.graphs)


class WeightsPerStep(L.Callback):
    """Keeps this rank's stage's parameters whole (a DTensor's shards gathered over its tensor-parallel group) as
    training starts and after every step: ``history[k]`` is ``W_k`` by parameter name."""

    def __init__(self) -> None:
        self.history: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.history.append(stage_weights(pl_module)["stage_weights"])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.history.append(stage_weights(pl_module)["stage_weights"])


def chosen_optimizer(model: Llama, kind: str) -> torch.optim.Optimizer:
    """``optim.Muon`` over the model's named parameters (the blocks' matrices to Muon, embedding, head and norms to
    its AdamW), alone or inside ``ErrorFeedback``; or a delay correction over the model's own AdamW groups:
    "delay_compensation" (``DelayCompensation(AdamW)``, coefficient ``CORRECTION``), "weight_prediction"
    (``WeightPrediction(AdamW)``), "async_nesterov" (``AsyncNesterov`` at the model's learning rate)."""
    from functools import partial

    from lightning_async_pp.optim import AsyncNesterov, DelayCompensation, ErrorFeedback, Muon, WeightPrediction
    from lightning_async_pp.optim.groups import decay_matrices_only

    make = partial(Muon, lr=model.hparams.lr, weight_decay=0.1)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=model.hparams.lr)
    if kind == "muon":
        return make(model.named_parameters())
    if kind == "error_feedback_muon":
        return ErrorFeedback(model.named_parameters(), optimizer=make)
    groups = decay_matrices_only(model.named_parameters(), model.hparams.weight_decay)
    adamw = partial(torch.optim.AdamW, lr=model.hparams.lr, betas=(0.9, 0.95))
    if kind == "delay_compensation":
        return DelayCompensation(groups, optimizer=adamw, coefficient=CORRECTION)
    if kind == "weight_prediction":
        return WeightPrediction(groups, optimizer=adamw)
    assert kind == "async_nesterov", kind
    return AsyncNesterov(groups, lr=model.hparams.lr)


def build(cfg: dict) -> tuple[Llama, DataLoader, L.Trainer]:
    L.seed_everything(cfg.get("seed", 0), verbose=False)
    tie = cfg.get("tie", True)
    if cfg.get("untie_on_other_ranks") and os.environ.get("LOCAL_RANK", "0") != "0":
        tie = not tie  # a model that differs between processes (the launcher sets LOCAL_RANK for rank 1)
    kwargs: dict[str, Any] = {}
    if cfg.get("groups_by_name"):
        kwargs["rank_dependent_lr"] = cfg["groups_by_name"] == "rank_dependent"
    model: Any
    if cfg.get("model") == "own":
        model = OwnPlanLM(lr=cfg.get("lr", 3e-3))
    elif cfg.get("model") == "gpt":
        model = (GPTSwappedShards if cfg.get("swap_shards") else GPT)(
            vocab_size=cfg.get("vocab", 256), block_size=cfg.get("max_seq_len", 64), n_layer=4, n_head=4, n_embd=32,
            learning_rate=cfg.get("lr", 3e-3))
    elif cfg.get("model") == "hf":
        config: Any = {**HF_LLAMA, **cfg.get("hf_config", {}), "tie_word_embeddings": tie}
        if cfg.get("pretrained"):  # a save_pretrained folder's config and weights
            config = None
        model = (HFSwappedShards if cfg.get("swap_shards") else HFMisroutedExperts if cfg.get("misroute_experts")
                 else HFUnsummed if cfg.get("unsummed")
                 else HuggingFaceCausalLM)(
            config, lr=cfg.get("lr", 3e-3), init_seed=cfg.get("seed", 0), pretrained=cfg.get("pretrained"))
    else:
        kind = (LlamaGroupedByName if cfg.get("groups_by_name") else LlamaSwappedShards if cfg.get("swap_shards")
                else LlamaMisroutedExperts if cfg.get("misroute_experts") else Llama)
        model = kind("tiny", vocab_size=cfg.get("vocab", 256), tie_embeddings=tie, max_seq_len=cfg.get("max_seq_len", 64),
                     lr=cfg.get("lr", 3e-3), skip_document_ends=bool(cfg.get("packed")) and cfg.get("skip_ends", True),
                     **cfg.get("experts", {}),
                     **kwargs)
    if cfg.get("optimizer"):
        model.configure_optimizers = lambda: chosen_optimizer(model, cfg["optimizer"])  # type: ignore[method-assign]
    rows: Any = token_rows(cfg.get("samples", 32), cfg.get("seq", 16))
    if cfg.get("packed"):
        rows = packed_rows(rows)
    batch = cfg.get("batch", 8)
    if cfg.get("data_parallel", 1) > 1 and cfg.get("devices", 2) == 1:
        rows, batch = replica_batches(rows, cfg["data_parallel"], batch, cfg.get("seed", 0), cfg.get("only_replica"),
                                      cfg.get("replica_epoch", 0))
    if cfg.get("resumable"):
        from helpers import ResumableLoader

        loader: Any = ResumableLoader(rows, batch_size=batch)
    else:
        loader = DataLoader(rows, batch_size=batch, shuffle=False, drop_last=True)
    return model, loader, make_trainer(cfg)


def replica_batches(rows: list, replicas: int, batch: int, seed: int, only: Any = None,
                    epoch: int = 0) -> tuple[list, int]:
    """The rows and batch size with which one device trains what ``replicas`` data-parallel replicas of ``batch``
    rows each train in epoch ``epoch`` (default the first): each replica reads the rows of its
    ``DistributedSampler`` (Lightning's for training: shuffled with the run's seed and the epoch, rank = the
    replica); step k's batch is every replica's batch k, replica 0's first (or replica ``only``'s alone)."""
    from torch.utils.data import DistributedSampler

    def sampler(r: int) -> DistributedSampler:
        s = DistributedSampler(rows, replicas, r, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        return s

    shards = [[rows[i] for i in sampler(r)] for r in range(replicas)]
    if only is not None:
        return shards[only], batch
    return [row for k in range(len(shards[0]) // batch) for shard in shards
            for row in shard[k * batch : (k + 1) * batch]], batch * replicas


def make_trainer(cfg: dict) -> L.Trainer:
    kwargs: dict[str, Any] = {}
    microbatches = cfg.get("microbatches", 4)
    if cfg.get("partition"):
        kwargs["partition"] = cfg["partition"]
    if cfg.get("devices", 2) == 1:
        kwargs["num_stages"] = cfg.get("stages", 2)  # the one-device emulation of the same pipeline
        if cfg.get("only_replica") is None:  # the replicas' microbatches, of a replica's microbatch size
            microbatches *= cfg.get("data_parallel", 1)
    elif cfg.get("data_parallel", 1) > 1:
        kwargs["data_parallel_size"] = cfg["data_parallel"]
    if cfg.get("tensor_parallel"):
        kwargs.update(tensor_parallel_size=cfg["tensor_parallel"], gather_final_weights=bool(cfg.get("gather")))
    if cfg.get("expert_parallel") and cfg.get("devices", 2) > 1:
        kwargs.update(expert_parallel_size=cfg["expert_parallel"], gather_final_weights=bool(cfg.get("gather")))
    from lightning_async_pp.parallel.expert import ExpertGradients

    ExpertGradients.UNAVERAGED = bool(cfg.get("unaveraged_experts"))  # the control; each case sets its own
    for key in ("activation_checkpointing", "stage_memory_gib"):
        if cfg.get(key) is not None:
            kwargs[key] = cfg[key]
    from lightning_async_pp.pipeline.comm import StageLink

    StageLink.REUSE_BUFFERS_ON_CPU = bool(cfg.get("pool_buffers"))  # what CUDA does; each case sets its own
    kwargs.update(cfg.get("strategy_kwargs", {}))
    graphs = None
    if cfg.get("compile_counted"):  # compiled layers through a backend that counts the graphs it is given
        graphs = GraphsPerBatch()
        kwargs["compile"] = {"backend": graphs.backend}
    strategy = AsyncPipelineStrategy(schedule=cfg.get("schedule", "2bw"), num_microbatches=microbatches,
                                     pipeline_timeout=cfg.get("timeout", 60.0), **kwargs)
    callbacks: list[Any] = [graphs] if graphs is not None else []
    if cfg.get("save_at"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        callbacks.append(ModelCheckpoint(dirpath=cfg["checkpoint_dir"], filename="saved", save_top_k=-1,
                                         every_n_train_steps=cfg["save_at"]))
    if cfg.get("text_samples") is not None:
        from lightning_async_pp.callbacks import TextSamples

        callbacks.append(TextSamples(**cfg["text_samples"]))
    logger: Any = False
    if cfg.get("log_dir"):
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(cfg["log_dir"], name="", version=0)
    if cfg.get("monitors"):
        from callback_fit import MemoryLogger

        from lightning_async_pp.callbacks import PipelineMonitor, StalenessMonitor

        callbacks += [StalenessMonitor(), PipelineMonitor(), WeightsPerStep()]
        if cfg.get("experts"):
            from lightning_async_pp.callbacks import ExpertMonitor

            callbacks.append(ExpertMonitor())
        logger = MemoryLogger()
    val_every = cfg.get("val_every")
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=cfg.get("devices", 2), max_steps=cfg.get("steps", 4),
        logger=logger, callbacks=callbacks, enable_checkpointing=bool(cfg.get("save_at")), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1, gradient_clip_val=cfg.get("clip"),
        limit_val_batches=cfg.get("val_batches", 1) if val_every or cfg.get("sequence") else 0, val_check_interval=val_every,
    )
    return trainer


def skewed_times(skew: dict, tensor_parallel: int) -> Any:
    """A context in which ``layer_cost="measured"``'s timing on tensor-parallel rank ``skew["tp_rank"]`` multiplies
    layer ``skew["layer"]``'s time by ``skew["factor"]`` (the ranks' timings then differ); what each call timed, as
    this rank returns it, is appended to the yielded list."""
    import contextlib

    import torch.distributed as dist

    from lightning_async_pp.plan import timing

    @contextlib.contextmanager
    def patched() -> Any:
        measure, seen = timing.measure_layer_times, []

        def skewed(*args: Any, **kwargs: Any) -> list[float]:
            times = measure(*args, **kwargs)
            if dist.get_rank() % tensor_parallel == skew["tp_rank"]:
                times[skew["layer"]] *= skew["factor"]
            seen.append(list(times))
            return times

        timing.measure_layer_times = skewed
        try:
            yield seen
        finally:
            timing.measure_layer_times = measure

    return patched()


@contextmanager
def counting_expert_reads(counts: dict[str, int]) -> Iterator[None]:
    """Within: ``counts["calls"]`` counts ``run_experts`` calls on real tensors, ``counts["reads"]`` the host reads (``tolist``,
    ``item``) that parallel/expert.py's own code issues (its forward and its all-to-all's backward)."""
    from lightning_async_pp.models import routed_experts
    from lightning_async_pp.parallel import expert as expert_parallel

    run_experts, reads = routed_experts.run_experts, {"tolist": torch.Tensor.tolist, "item": torch.Tensor.item}

    def counted_run(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        counts["calls"] += not isinstance(x, FakeTensor)  # the split's cost model runs the layers on fake tensors
        return run_experts(x, *args, **kwargs)

    def counted(original: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code.co_filename == expert_parallel.__file__:
                counts["reads"] += 1
            return original(tensor, *args, **kwargs)
        return read

    routed_experts.run_experts = counted_run
    for name, original in reads.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield
    finally:
        routed_experts.run_experts = run_experts
        for name, original in reads.items():
            setattr(torch.Tensor, name, original)


class RowsDataModule(L.LightningDataModule):
    """The rows of ``loader`` from a data module declaring them as ``data.TextDataModule`` does: ``block_size``
    tokens per row (and its target), ``document_mask`` for packed rows."""

    def __init__(self, loader: DataLoader, block_size: int, document_mask: bool) -> None:
        super().__init__()
        self.loader, self.block_size, self.document_mask = loader, block_size, document_mask

    def train_dataloader(self) -> DataLoader:
        return self.loader


class BatchesStarted(L.Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.count += 1


def refused_setup(cfg: dict, model: Llama, loader: DataLoader, trainer: L.Trainer) -> dict:
    """``cfg["refused"]``: fit on the rows as a data module; what fit raised (the user's error), how many batches
    started, and whether every parameter is on the meta device again after the teardown."""
    started = BatchesStarted()
    trainer.callbacks.append(started)
    try:
        trainer.fit(model, datamodule=RowsDataModule(loader, cfg.get("seq", 16), bool(cfg.get("packed"))))
    except Exception as err:
        return {"refused": f"{type(err).__name__}: {err}", "batches_started": started.count,
                "meta": all(p.is_meta for p in model.parameters())}
    raise AssertionError("the setup was not refused")


def run(cfg: dict, devices: int) -> tuple[dict, Llama, L.Trainer]:
    if cfg.get("sequence"):
        return run_sequence(cfg, devices)
    if cfg.get("skew_times"):
        with skewed_times(cfg["skew_times"], cfg.get("tensor_parallel", 1)) as seen:
            result, model, trainer = run({**cfg, "skew_times": None}, devices)
        result["own_times"] = seen
        return result, model, trainer
    model, loader, trainer = build({**cfg, "devices": devices})
    if cfg.get("refused"):
        return refused_setup(cfg, model, loader, trainer), model, trainer
    # A resumable loader records its own position: validation reads another one.
    val_loader = eval_rows(cfg) if cfg.get("resumable") else loader
    expert_reads = {"calls": 0, "reads": 0}
    with counting_expert_reads(expert_reads) if cfg.get("count_expert_reads") else nullcontext():
        trainer.fit(model, loader, val_loader if cfg.get("val_every") else None, ckpt_path=cfg.get("resume_from"))
    if cfg.get("save_after"):
        trainer.save_checkpoint(cfg["save_after"])  # after fit, as Lightning users habitually save
    result: dict[str, Any] = {"rank": trainer.global_rank, "global_step": trainer.global_step,
                              "split": (trainer.strategy.engine.stats.split.method,
                                        list(trainer.strategy.engine.stats.split.counts)),
                              "split_cost": trainer.strategy.engine.stats.split.cost}
    if "val_loss" in trainer.callback_metrics:
        result["val_loss"] = float(trainer.callback_metrics["val_loss"])
    counted = [c for c in trainer.callbacks if isinstance(c, GraphsPerBatch)]
    if counted:
        result["graphs_per_batch"] = counted[0].after_batch


    if cfg.get("count_expert_reads"):
        result["expert_reads"] = expert_reads
    if cfg.get("monitors"):  # what the monitors logged (rank 0's logger writes) and the weights they saw
        result["weights_per_step"] = next(c for c in trainer.callbacks if isinstance(c, WeightsPerStep)).history
        if trainer.is_global_zero:
            result["logged"] = {n: v for n, v in trainer.logger.metrics.items()
                                if n.startswith(("staleness/", "pipeline/", "experts/"))}
    samples = [c for c in trainer.callbacks if type(c).__name__ == "TextSamples"]
    if samples:
        result["texts"] = samples[0].history
    if cfg.get("expert_parallel") and devices > 1 and not cfg.get("gather"):
        result.update(stage_weights(model))
    elif cfg.get("tensor_parallel") and devices > 1 and not cfg.get("gather"):
        result.update(stage_weights(model))
        link = trainer.strategy.engine._link  # what crossed the stage boundary: this rank's shapes
        layout = link.out_layout or link.in_layout  # none on one stage
        result["crossed"] = [list(m.shape) for m in layout.metas] if layout is not None else []
        if "muon" in cfg.get("optimizer", ""):
            result["muon_step_difference"] = muon_step_against_whole(model)
    elif trainer.is_global_zero:
        result["state_dict"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        if cfg.get("expert_parallel") and devices > 1:  # the gathered model computes alone (no expert group)
            from lightning_async_pp.models.routed_experts import take_statistics

            with torch.no_grad():
                logits, _ = take_statistics(model.pipeline_forward(next(iter(loader))))
            result["runs_alone"] = bool(torch.isfinite(logits).all())
    if cfg.get("eval_calls"):
        result["eval"] = evaluate(model, eval_rows(cfg), cfg, devices)
    return result, model, trainer


def eval_rows(cfg: dict) -> DataLoader:
    return DataLoader(token_rows(cfg.get("samples", 32), cfg.get("seq", 16)), batch_size=cfg.get("batch", 8))


def evaluate(model: Llama, loader: Any, cfg: dict, devices: int) -> dict[str, Any]:
    """``cfg["eval_calls"]`` on the trained model, each on a new Trainer (no validation inside them)."""
    out: dict[str, Any] = {}
    for call in cfg["eval_calls"]:
        # "sequence": validate runs limit_val_batches=val_batches batches
        trainer = make_trainer({**cfg, "devices": devices, "save_at": None, "val_every": None, "sequence": [call]})
        if call == "predict":
            outputs = trainer.predict(model, loader)
            out[call] = torch.cat(outputs).cpu() if outputs and outputs[0] is not None else None
        else:
            out[call] = {k: float(v) for k, v in getattr(trainer, call)(model, loader, verbose=False)[0].items()}
    return out


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
        if cfg.get("record_state_bytes"):  # what the split's memory check counted of the optimizer, per layer
            record["optimizer_state_bytes"] = trainer.strategy.engine.optimizer_state_bytes
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
