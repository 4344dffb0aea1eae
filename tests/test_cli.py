import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_async_pp
from lightning_async_pp.cli import AsyncPipelineCLI
from lightning_async_pp.data import TextDataModule
from lightning_async_pp.models import GPT

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
STRATEGY_EXISTS = hasattr(lightning_async_pp, "AsyncPipelineStrategy")


@pytest.fixture(autouse=True)
def no_pytest_argv(monkeypatch):
    # LightningCLI(args=...) warns when sys.argv holds arguments too (here: pytest's own).
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])


def demo_config(tmp_path: Path) -> Path:
    """configs/demo.yaml as `make demo` runs it, but tiny, with its cache and logs under tmp_path."""
    config = yaml.safe_load(DEMO.read_text())
    if not STRATEGY_EXISTS:
        # The real strategy goes here: until lightning_async_pp.AsyncPipelineStrategy exists, run the demo config
        # under Lightning's default strategy. Once it exists, the config's own strategy entry is used unchanged.
        config["trainer"]["strategy"] = "auto"
    # One process: under pytest, Lightning's launcher would re-run the whole test session for a second rank.
    config["trainer"].update(devices=1, max_steps=2, limit_val_batches=2, val_check_interval=2, log_every_n_steps=1)
    config["trainer"]["callbacks"][1]["init_args"].update(trace_steps=[0, 0], schedule_image_every_n_steps=2)
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["trainer"]["default_root_dir"] = str(tmp_path)
    config["model"]["init_args"].update(block_size=32, n_layer=2, n_head=2, n_embd=32)
    config["data"].update(block_size=32, batch_size=4, max_bytes=60_000, cache_dir=str(tmp_path / "cache"))
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_demo_config_describes_the_pipeline_run():
    config = yaml.safe_load(DEMO.read_text())
    assert config["trainer"]["strategy"] == {
        "class_path": "lightning_async_pp.AsyncPipelineStrategy",
        "init_args": {"schedule": "2bw", "num_microbatches": 4},
    }
    assert config["trainer"]["accelerator"] == "cpu" and config["trainer"]["devices"] == 2  # two stages
    monitors = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert monitors == ["lightning_async_pp.callbacks.StalenessMonitor", "lightning_async_pp.callbacks.PipelineMonitor"]
    # The picture of the executed schedule, at steps k with (k + 1) % n == 0: several within the run.
    n = config["trainer"]["callbacks"][1]["init_args"]["schedule_image_every_n_steps"]
    assert len([k for k in range(config["trainer"]["max_steps"]) if (k + 1) % n == 0]) >= 2
    assert config["model"]["class_path"] == "lightning_async_pp.models.GPT"
    assert config["model"]["init_args"]["block_size"] == config["data"]["block_size"]
    assert config["trainer"]["logger"]["class_path"].endswith("TensorBoardLogger")
    # A delay-tolerant optimizer with the delay correction around it.
    assert config["optimizer"]["class_path"] == "lightning_async_pp.optim.ErrorFeedback"
    assert config["optimizer"]["init_args"]["optimizer"]["class_path"] == "lightning_async_pp.optim.Muon"


def test_demo_config_trains_two_steps_and_says_where_the_logs_are(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cli = AsyncPipelineCLI(args=["fit", "--config", str(demo_config(tmp_path))])
    assert isinstance(cli.model, GPT) and cli.model.hparams.n_embd == 32
    assert isinstance(cli.datamodule, TextDataModule) and cli.datamodule.max_bytes == 60_000
    if STRATEGY_EXISTS:
        assert isinstance(cli.trainer.strategy, lightning_async_pp.AsyncPipelineStrategy)
    assert cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    log_dir = Path(cli.trainer.logger.log_dir)
    assert log_dir.is_relative_to(tmp_path / "logs") and list(log_dir.glob("events.out.tfevents.*"))
    # the demo's monitors write their figures and trace there
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(log_dir)).Reload().Tags()
    assert {"staleness/drift", "staleness/delay", "pipeline/tokens_per_sec", "pipeline/bubble_fraction"} <= set(tags["scalars"])
    assert "pipeline/schedule" in tags["images"]  # the picture of the executed schedule
    assert (log_dir / "pipeline_trace.json").exists()
    out = capsys.readouterr().out
    assert out.count(f"tensorboard --logdir {tmp_path / 'logs' / 'demo'}") == 2  # before and after fit
    assert str(log_dir) in out


def test_optimizer_from_the_config_receives_named_parameters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = AsyncPipelineCLI(
        args=["--config", str(demo_config(tmp_path)), "--optimizer=torch.optim.AdamW", "--optimizer.lr=0.01"],
        run=False,
    )
    optimizer = cli.model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 0.01
    assert optimizer.param_groups[0]["param_names"] == [n for n, _ in cli.model.named_parameters()]
    assert "parameters" not in vars(cli.model)  # the model's own parameters() is back
    assert len(list(cli.model.parameters())) == len(optimizer.param_groups[0]["params"])


def test_tensorboard_is_the_default_logger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "minimal.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"accelerator": "cpu", "devices": 1, "strategy": "auto"},
        "model": {"class_path": "lightning_async_pp.models.GPT", "init_args": {"n_layer": 1, "n_embd": 32}},
    }))
    cli = AsyncPipelineCLI(args=["--config", str(config)], run=False)
    assert isinstance(cli.trainer.logger, TensorBoardLogger)
    assert cli.trainer.logger.save_dir == "lightning_logs"


def test_console_script_exits_zero_after_fit(tmp_path):
    # What the `lightning-async-pp` entry point does: sys.exit(main()).
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from lightning_async_pp.cli import main; sys.exit(main())",
         "fit", "--config", str(demo_config(tmp_path)), "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
         "--trainer.enable_progress_bar=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensorboard --logdir" in proc.stdout


def test_missing_data_path_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        AsyncPipelineCLI(args=["--config", str(demo_config(tmp_path)), f"--data.data_path={missing}"], run=False)



@pytest.mark.parametrize("config, key, value, blocks, width", [
    ("hf_llama_tiny.yaml", "hidden_size", 48, 4, 48),  # the embedding's width changes
    ("litgpt_tiny.yaml", "n_layer", 2, 2, 128),  # the number of blocks changes
])
def test_one_key_of_an_adapter_config_mapping_is_overridden_from_the_command_line(tmp_path, monkeypatch, config, key,
                                                                                  value, blocks, width):
    pytest.importorskip("transformers" if config.startswith("hf") else "litgpt")
    monkeypatch.chdir(tmp_path)
    path = DEMO.parent / config
    cli = AsyncPipelineCLI(args=["--config", str(path), "--trainer.devices=1", "--trainer.strategy=auto",
                                 f"--model.init_args.config.{key}", str(value)], run=False)
    assert getattr(cli.model.config, key) == value
    # The mapping's other keys are the YAML's.
    from_yaml = yaml.safe_load(path.read_text())["model"]["init_args"]["config"]
    kept = {k: v for k, v in from_yaml.items() if k not in (key, "name")}
    assert {k: getattr(cli.model.config, k) for k in kept} == kept
    cli.model.configure_model()
    layers = cli.model.pipeline_layers()
    assert len(layers) == blocks + 3 and layers[0].weight.shape[1] == width


@pytest.mark.parametrize("override, reason", [
    ("--trainer.strategy.init_args.schedule=2bv",  # the strategy refuses it when it is built
     "error: Unknown schedule '2bv' (did you mean '2bw'?); valid schedules are '2bw', '1f1b', 'gpipe', 'zb_h1'"),
    ("--trainer.strategy.init_args.num_microbatch=4",  # jsonargparse refuses it while parsing
     "error: trainer.strategy: AsyncPipelineStrategy: 'num_microbatch' is not one of its options "
     "(did you mean 'num_microbatches'?)"),
    ("--data.documnet_mask=true",  # a key no class takes: jsonargparse names it alone
     "error: unrecognized arguments: --data.documnet_mask=true (did you mean 'data.document_mask'?)"),
])
def test_the_console_script_ends_a_refused_configuration_with_its_one_line_reason(tmp_path, monkeypatch, capsys,
                                                                                   override, reason):
    from lightning_async_pp.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(demo_config(tmp_path)), override])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == reason
    assert "Traceback" not in err and not any(line.startswith("usage:") for line in err)


@pytest.mark.parametrize("option, reason", [
    ("--model.skip_document_endz=true", "'skip_document_endz' is not one of its options (did you mean "
     "'skip_document_ends'? 'skip_document_ends' is an option of Llama, GPT, HuggingFaceCausalLM; the model's options "
     "come after its class"),
    ("--model.skip_document_ends=true", "'skip_document_ends' is not one of its options ('skip_document_ends' is an "
     "option of Llama, GPT, HuggingFaceCausalLM; the model's options come after its class"),
])
def test_a_model_option_read_before_the_models_class_is_refused_with_the_option_it_resembles_and_the_order(
        tmp_path, monkeypatch, capsys, option, reason):
    # Parsed only: the option, read before --config names the model's class, is checked against PipelineModule's
    from lightning_async_pp.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["fit", option, "--config", str(demo_config(tmp_path))])
    assert exited.value.code == 2
    assert reason in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_misspelt_data_key_in_a_config_file_is_refused_with_the_key_it_resembles(tmp_path, monkeypatch, capsys):
    from lightning_async_pp.cli import main

    monkeypatch.chdir(tmp_path)
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"data": {"documnet_mask": True}}))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(demo_config(tmp_path)), "--config", str(typo)])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: Subcommand 'fit' does not accept option 'data.documnet_mask' (did you mean 'data.document_mask'?)")


def test_consolidate_help_says_its_whole_first_sentence(capsys):
    from lightning_async_pp.consolidate import main as consolidate_main

    with pytest.raises(SystemExit) as exited:
        consolidate_main(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("Turn a sharded checkpoint into one Lightning checkpoint file (the newest weights and everything else), "
            "or into the upstream library's folder.") in text
    assert "python -m lightning_async_pp.consolidate SRC DST --hf [--tokenizer PATH]" in text


def test_ckpt_path_last_on_the_command_line_resumes_to_the_uninterrupted_weights(tmp_path, monkeypatch):
    """docs/guide/cli.md, "Saving and resuming": ModelCheckpoint(save_last=True) in the config, then the same command
    with ``--ckpt_path last``: 2 steps, stopped, resumed to 4, equal the 4 steps of a run that never stopped."""
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(demo_config(tmp_path).read_text())
    config["trainer"]["callbacks"].append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {
        "dirpath": str(tmp_path / "checkpoints"), "every_n_train_steps": 2, "save_last": True}})
    config["trainer"].update(enable_progress_bar=False, limit_val_batches=0)
    path = tmp_path / "resumable.yaml"
    path.write_text(yaml.safe_dump(config))
    AsyncPipelineCLI(args=["fit", "--config", str(path)])  # 2 steps
    assert (tmp_path / "checkpoints" / "last.ckpt").is_dir()
    resumed = AsyncPipelineCLI(args=["fit", "--config", str(path), "--ckpt_path", "last", "--trainer.max_steps=4"])
    assert resumed.trainer.ckpt_path == str(tmp_path / "checkpoints" / "last.ckpt")
    config["trainer"]["callbacks"].pop()
    config["trainer"].update(max_steps=4, enable_checkpointing=False)
    path.write_text(yaml.safe_dump(config))
    uninterrupted = AsyncPipelineCLI(args=["fit", "--config", str(path)])
    assert resumed.trainer.global_step == uninterrupted.trainer.global_step == 4
    expected = uninterrupted.model.state_dict()
    for name, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-6, msg=name)


def test_the_cli_gives_the_model_one_microbatch_of_the_data_modules_shape_to_cost_the_split_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 8 rows in 4 microbatches: 2 rows each (the model's own default sample is one row)
    cli = AsyncPipelineCLI(args=["--config", str(demo_config(tmp_path)), "--data.batch_size=8"], run=False)
    data, strategy = cli.datamodule, cli.trainer.strategy
    assert strategy.config.num_microbatches == 4
    assert cli.model.pipeline_sample().shape == (2, data.block_size + 1)
    assert strategy.config.partition == "balanced"


def test_data_help_lists_the_data_modules_options_beside_model_help(capsys):
    from lightning_async_pp.cli import main

    for option, expected in (("--data.help", "--data.data_path"), ("--model.help=GPT", "--model.n_layer")):
        with pytest.raises(SystemExit) as exited:
            main(["fit", option])
        assert exited.value.code == 0, option
        out = capsys.readouterr().out
        assert expected in out, (option, out[-2000:])


def test_a_value_the_library_refuses_once_the_run_started_ends_in_one_line_and_other_errors_keep_their_traceback(
        tmp_path, monkeypatch, capsys):
    from lightning_async_pp.cli import main
    from lightning_async_pp import checkpoint as ckpt

    monkeypatch.chdir(tmp_path)
    damaged = tmp_path / "damaged.ckpt"  # a sharded checkpoint whose save never finished
    damaged.mkdir()
    with pytest.raises(SystemExit) as exited:  # parsed and built; the strategy refuses the checkpoint when fit loads it
        main(["fit", "--config", str(demo_config(tmp_path)), f"--ckpt_path={damaged}"])
    assert exited.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: cannot read the checkpoint {str(damaged)!r}: the directory has no .metadata")
    assert "Traceback" not in "\n".join(err) and "JSONARGPARSE_DEBUG=true" in err[-2]
    # Only the package's own raise statements: Python's or another library's errors keep their traceback.
    from lightning_async_pp.cli import own_refusal

    with pytest.raises(ValueError) as ours:
        ckpt.check_sharded(str(damaged))
    with pytest.raises(ValueError) as python:
        int("not a number")
    assert own_refusal(ours.value) and not own_refusal(python.value)
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(ckpt.UnreadableCheckpoint):
        main(["fit", "--config", str(demo_config(tmp_path)), f"--ckpt_path={damaged}"])


def test_with_num_microbatches_left_at_its_default_the_cli_costs_the_split_on_one_microbatch_of_the_default_count(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(demo_config(tmp_path).read_text())
    del config["trainer"]["strategy"]["init_args"]["num_microbatches"]  # the default: max(4, stages) = 4
    config["trainer"]["strategy"]["init_args"]["num_stages"] = 2
    config["data"]["batch_size"] = 8
    path = tmp_path / "default_microbatches.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(args=["--config", str(path)], run=False)
    assert cli.trainer.strategy.config.num_microbatches is None and cli.trainer.strategy.num_microbatches == 4
    assert cli.model.pipeline_sample().shape == (2, cli.datamodule.block_size + 1)  # 8 rows / 4 microbatches


def test_the_cli_builds_with_the_data_in_subclass_mode_or_no_data_module(tmp_path, monkeypatch):
    # --data.help is ours only for a fixed data module: LightningCLI adds its own in the data's subclass mode (the
    # two conflicted), and with no data module there are no data options (building the CLI raised).
    monkeypatch.chdir(tmp_path)
    model = ["--model", "lightning_async_pp.models.GPT", "--trainer.max_steps", "1"]
    cli = AsyncPipelineCLI(args=model + ["--data", "lightning_async_pp.data.TextDataModule"], run=False,
                           subclass_mode_data=True)
    assert isinstance(cli.datamodule, TextDataModule)
    assert AsyncPipelineCLI(args=model, run=False, datamodule_class=None).datamodule is None


def test_a_refusal_a_failing_stage_printed_when_it_was_raised_is_not_repeated_by_the_console_script(
        monkeypatch, capsys):
    """Across processes the failing stage prints its error and traceback at once (strategy/failures.py); the
    console script then exits with status 1 without printing it again."""
    from types import SimpleNamespace

    from lightning_async_pp import cli
    from lightning_async_pp.pipeline.comm import FailureBoard
    from lightning_async_pp.strategy import failures, options

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # the hook it installs stays in this test
    monkeypatch.setattr(failures, "_HOOKED", [False])
    with pytest.raises(TypeError) as refused:
        options.refuse_unknown_keywords({"shedule": "2bw"})
    stage = SimpleNamespace(_reported=None, is_multiprocess=True, engine=SimpleNamespace(board=FailureBoard(None)),
                            topology=SimpleNamespace(stage=1), global_rank=1)
    failures.FailureReporting._report_failure(stage, refused.value)
    printed = capsys.readouterr().err
    assert printed.startswith("lightning_async_pp: stage 1 (rank 1) failed:\nTraceback")
    assert printed.count("unknown keyword") == 1

    def failing_cli(args=None):
        raise refused.value

    monkeypatch.setattr(cli, "_ConsoleCLI", failing_cli)
    with pytest.raises(SystemExit) as exited:
        cli.main(["fit"])
    assert exited.value.code == 1 and capsys.readouterr().err == ""
