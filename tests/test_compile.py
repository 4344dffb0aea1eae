"""Compiled pipeline layers (``AsyncPipelineStrategy(compile=...)``, docs/design/stages.md 'Compiled layers'): the same
numbers as eager layers, each kind of layer compiled once per process, and no recompilation when 2BW swaps weight
versions, across microbatches or on repeated evaluation.

Most runs compile through a backend that counts the graphs it is given and hands them to ``aot_eager`` (AOTAutograd's
forward and backward graphs, run by eager kernels): the same tracing as the default inductor backend at a fraction of
its compile time. One test runs inductor itself on a tiny engine.
"""
from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import TinyLM, make_dataset, one_device_trainer
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import seam_fit  # noqa: E402
from pipeline_runs import max_difference, run_here_on_one_device  # noqa: E402
from test_lightning_seam import seam_results  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402
from lightning_async_pp.pipeline.compiled import layer_kind  # noqa: E402
from lightning_async_pp.pipeline.config import PipelineConfig  # noqa: E402
from lightning_async_pp.pipeline.engine import PipelineEngine  # noqa: E402

TOL = 1e-5


class CountingBackend:
    """A torch.compile backend that counts the graphs it compiles and runs them through ``aot_eager``."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class GraphsSeen(L.Callback):
    """The backend's graph count after every training batch and every validation."""

    def __init__(self, backend: CountingBackend) -> None:
        self.backend = backend
        self.after_batch: list[int] = []
        self.after_validation: list[int] = []

    def on_train_batch_end(self, *args) -> None:
        self.after_batch.append(self.backend.graphs)

    def on_validation_end(self, *args) -> None:
        self.after_validation.append(self.backend.graphs)


def fit_tiny(compile, steps: int = 6, callbacks=(), precision=None, evaluate: bool = True,
             **strategy_kwargs) -> tuple[TinyLM, L.Trainer, list]:
    """TinyLM on two stages (one device) under 2BW; with ``evaluate``, validated every 2 batches during fit (another
    batch size than training), then ``trainer.validate`` twice on a set whose last batch is ragged. Returns the
    model, the trainer and every loss seen (training steps, validations during fit, the two validate calls)."""
    torch.manual_seed(0)
    model = TinyLM(optimizer="adamw")
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2, compile=compile, **strategy_kwargs)
    extra = {"precision": precision} if precision else {}
    losses = Losses()
    trainer = one_device_trainer(strategy, steps, callbacks=[losses, *callbacks], val_check_interval=2 if evaluate else None,
                                 limit_val_batches=1.0 if evaluate else 0, **extra)
    val = DataLoader(make_dataset(32, seed=2), batch_size=16) if evaluate else None
    trainer.fit(model, DataLoader(make_dataset(64), batch_size=8), val)
    if evaluate:
        ragged = DataLoader(make_dataset(60, seed=3), batch_size=8)  # 7 batches of 8, then 4 rows: microbatches of 1
        for _ in range(2):
            losses.values.append(trainer.validate(model, ragged, verbose=False)[0]["val_loss"])
    return model, trainer, losses.values


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, *args) -> None:
        self.values.append(float(outputs["loss"]))

    def on_validation_end(self, trainer, module) -> None:
        if trainer.state.fn == "fit":
            self.values.append(float(trainer.callback_metrics["val_loss"]))


def assert_same_numbers(a: tuple, b: tuple, expected_losses: int = 6 + 3 + 2) -> None:
    (model_a, _, losses_a), (model_b, _, losses_b) = a, b
    assert len(losses_a) == len(losses_b) == expected_losses
    torch.testing.assert_close(torch.tensor(losses_a), torch.tensor(losses_b), rtol=0, atol=TOL)
    assert max_difference(model_a.state_dict(), model_b.state_dict()) <= TOL


# ---- the option ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [
    ("yes", r"compile must be True, False or a mapping of torch.compile keyword arguments .*got 'yes'"),
    (1, r"got 1"),
    ({"modee": "max-autotune"}, r"unknown torch.compile keyword argument\(s\) 'modee' \(did you mean 'mode'\?\)"),
    ({"fullgraph": "yes"}, r"'fullgraph' must be True or False, got 'yes'"),
    ({"mode": "fastest"}, r"compile=\{'mode': 'fastest'\} is refused by torch.compile: .*max-autotune"),
    ({"backend": "no_such_backend"}, r"refused by torch.compile: .*no_such_backend"),
])
def test_a_bad_compile_value_is_refused_at_construction_naming_it_and_what_is_valid(bad, match):
    with pytest.raises(ValueError, match=match):
        AsyncPipelineStrategy("2bw", compile=bad)


def test_compile_with_zb_h1_is_refused_because_a_compiled_layer_cannot_split_its_backward():
    with pytest.raises(ValueError, match=r"schedule='zb_h1'.*one autograd node.*schedule='1f1b'"):
        PipelineConfig(schedule="zb_h1", compile=True)
    assert PipelineConfig(schedule="1f1b", compile={"backend": "aot_eager"}).compile_options() == {"backend": "aot_eager"}
    assert PipelineConfig().compile_options() is None
    assert PipelineConfig(compile={}).compile_options() == {}  # torch.compile's own defaults
    # True: inductor, rounding bf16 intermediates and drawing random numbers as eager does
    assert PipelineConfig(compile=True).compile_options() == {
        "options": {"emulate_precision_casts": True, "fallback_random": True}}


def test_layers_of_one_kind_share_compiled_code_and_other_shapes_do_not():
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    assert layer_kind(block) == layer_kind(copy.deepcopy(block))
    assert layer_kind(block) != layer_kind(nn.Sequential(nn.Linear(8, 4), nn.Tanh()))
    assert layer_kind(block) != layer_kind(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    assert layer_kind(block) != layer_kind(copy.deepcopy(block).to(torch.bfloat16))


def test_more_layer_kinds_than_dynamos_recompile_limit_all_run_compiled():
    # All nn.Module compiles share one code object, whose recompile_limit (8) would send every layer beyond the
    # eighth distinct graph back to eager, silently. Each kind compiles in its own region instead.
    from lightning_async_pp.pipeline.stage import Stage

    backend = CountingBackend()
    widths = list(range(2, 14))
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]  # 11 layers of 11 kinds
    stage = Stage(layers, 0, 1, delay=0, compile_options={"backend": backend})
    x = torch.randn(3, 2)
    with torch.no_grad():
        compiled = [stage.forward_newest(x) for _ in range(2)]
        eager = x
        for layer in layers:
            eager = layer(eager)
    assert backend.graphs == len(layers)  # one per kind, none on the second pass
    for out in compiled:
        torch.testing.assert_close(out, eager, rtol=0, atol=TOL)


# ---- exact, and compiled once -------------------------------------------------------------------------------------
def test_compiled_2bw_run_equals_eager_and_never_recompiles_across_versions_microbatches_or_evaluation():
    backend = CountingBackend()
    seen = GraphsSeen(backend)
    compiled = fit_tiny({"backend": backend}, callbacks=[seen])
    assert_same_numbers(compiled, fit_tiny(False))
    # TinyLM's layers are of 3 kinds (Linear(4, 8); Tanh + Linear(8, 8), twice; Tanh + Linear(8, 1)): the first
    # batch compiles one training graph per kind, and no later batch (2BW reads the stash W_{k-1} from the second
    # batch on, each through 4 microbatches) compiles anything. Evaluation runs under no_grad (validation within
    # fit, after batches 2, 4 and 6) or inference_mode (trainer.validate): one graph per kind each, the first time
    # only. Other batch sizes (microbatches of 4 rows in fit's validation, of 2 in validate) share it, the batch
    # dimension being dynamic once dynamo has seen two sizes; a ragged last batch of 4 rows in 4 microbatches has
    # microbatches of one row, which dynamo specializes (one more graph per kind, once).
    kinds = 3
    assert seen.after_batch == [kinds] * 2 + [2 * kinds] * 4
    assert seen.after_validation == [2 * kinds] * 3 + [4 * kinds] * 2
    assert backend.graphs == 4 * kinds


def test_compiled_layers_with_bf16_and_activation_checkpointing_equal_eager():
    backend = CountingBackend()
    on = fit_tiny({"backend": backend}, precision="bf16-mixed", evaluate=False, activation_checkpointing=True)
    off = fit_tiny(False, precision="bf16-mixed", evaluate=False, activation_checkpointing=True)
    assert_same_numbers(on, off, expected_losses=6)
    assert backend.graphs == 3  # one per layer kind: the recomputation in backward reuses the training graphs
    assert compiled_layers_ran(on[1])


def compiled_layers_ran(trainer: L.Trainer) -> bool:
    return all(type(call).__name__ == "CompiledLayer" for st in trainer.strategy.engine.stages for call in st.layers.calls)


@pytest.mark.slow
@pytest.mark.parametrize("bf16, dropout", [(True, 0.0), (False, 0.25)])
def test_inductor_compiled_engine_equals_eager_with_checkpointed_layers(bf16, dropout):
    """compile=True (inductor, generated C++ kernels on CPU) on a 2-stage engine driven as the strategy drives it,
    two of four layers checkpointed: 2BW's losses and weights equal eager's to 1e-5, under bf16 autocast (as
    precision="bf16-mixed" runs it) and with dropout. Inductor's own defaults (compile={}) keep fp32 intermediates
    in fused bf16 kernels and draw dropout masks from their own generator; compile=True rounds and draws as eager
    does. (bf16 and dropout together stay one bf16 rounding apart: 1e-4 in this run; docs/design/index.md.)"""

    def train(compile) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        root = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(dropout)) for _ in range(4)])
        config = PipelineConfig(schedule="2bw", num_microbatches=2, num_stages=2, compile=compile,
                                activation_checkpointing=[1, 3])
        engine = PipelineEngine.build(root, list(root), config, input_fn=lambda b: b[0],
                                      loss_fn=lambda out, b: ((out.float() - b[1]) ** 2).mean(),
                                      device=torch.device("cpu"))
        engine.start()
        optimizer = torch.optim.AdamW(engine.params, lr=0.01)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(4)]
        losses = []
        for i, batch in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                losses.append(float(engine.train_step(batch, batches[i + 1] if i + 1 < len(batches) else None)))
            for p, grad in zip(engine.params, engine.gradients):
                p.grad = grad
            engine.prepare_update()
            optimizer.step()
            engine.release_gradients()
        return losses, [p.detach().clone() for p in root.parameters()]

    eager_losses, eager_weights = train(False)
    losses, weights = train(True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=0, atol=TOL)
    for w, e in zip(weights, eager_weights):
        torch.testing.assert_close(w, e, rtol=0, atol=TOL)


# ---- torch.compile(model) -----------------------------------------------------------------------------------------
def test_torch_compile_of_the_whole_module_is_undone_and_its_layers_compiled_instead_with_a_warning():
    backend = CountingBackend()
    torch.manual_seed(0)
    model = TinyLM(optimizer="adamw")
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2, compile={"backend": backend})
    with pytest.warns(UserWarning, match=r"torch.compile\(model\).*undone.*each pipeline layer is compiled with the "
                                         r"strategy's compile="):
        one_device_trainer(strategy, 4).fit(torch.compile(model), DataLoader(make_dataset(64), batch_size=8))
    assert backend.graphs == 3  # per layer kind: the engine's layers, not the LightningModule's steps
    assert model._compiler_ctx is None  # the module's own methods again, not dynamo's wrappers of them
    for step in ("forward", "training_step", "validation_step", "predict_step"):
        assert getattr(getattr(model, step), "__func__", None) is getattr(type(model), step)
    torch.manual_seed(0)
    eager = TinyLM(optimizer="adamw")
    one_device_trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2), 4).fit(
        eager, DataLoader(make_dataset(64), batch_size=8))
    assert max_difference(model.state_dict(), eager.state_dict()) <= TOL

    # Without the strategy's own option the layers get torch.compile's defaults (no step runs here: max_steps=0).
    strategy = AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2)
    with pytest.warns(UserWarning, match=r"compiled with torch.compile's defaults \(compile=True\)"):
        one_device_trainer(strategy, 0).fit(torch.compile(TinyLM()), DataLoader(make_dataset(64), batch_size=8))
    assert strategy.config.compile is True


def test_an_uncompiled_module_gives_no_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*torch.compile\(model\).*")
        one_device_trainer(AsyncPipelineStrategy("2bw", num_microbatches=4, num_stages=2), 0).fit(
            TinyLM(), DataLoader(make_dataset(64), batch_size=8))


# ---- across processes -------------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
def test_compiled_layers_on_two_processes_equal_the_eager_one_device_run(tmp_path):
    cfg = dict(model={"optimizer": "adamw"}, schedule="2bw", steps=6, data={"samples": 64, "batch": 8},
               microbatches=4, after=["validate"], eval_data={"kind": "seq", "samples": 60, "batch": 8,
                                                              "drop_last": False},
               use_distributed_sampler=False)
    multi = seam_results(dict(cfg, strategy_kwargs={"compile": {"backend": "aot_eager"}}), tmp_path)[0]
    one = run_here_on_one_device(seam_fit.run, dict(cfg, strategy_kwargs={"num_stages": 2}))
    torch.testing.assert_close(torch.tensor(multi["losses"]), torch.tensor(one["losses"]), rtol=0, atol=TOL)
    assert max_difference(multi["state_dict"], one["state_dict"]) <= TOL
    assert abs(multi["validate"][0]["val_loss"] - one["validate"][0]["val_loss"]) <= TOL


# ---- LightningCLI -----------------------------------------------------------------------------------------------
def test_compile_is_set_from_the_command_line_or_yaml(tmp_path, monkeypatch):
    from test_cli import demo_config

    from lightning_async_pp.cli import AsyncPipelineCLI

    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])  # LightningCLI(args=...) warns about pytest's own
    config = str(demo_config(tmp_path))
    for arg, expected in [("true", True), ('{"backend": "aot_eager", "dynamic": false}', {"backend": "aot_eager", "dynamic": False})]:
        cli = AsyncPipelineCLI(args=["--config", config, f"--trainer.strategy.compile={arg}"], run=False)
        assert cli.trainer.strategy.config.compile == expected
