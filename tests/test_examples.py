"""Every example under examples/ runs (at tiny size) or, for the cluster launchers, parses as launched.

- ``own_model.py``: a model of one's own trains with 2BW, one device emulating two stages;
- ``moe.yaml``: a Mixtral through the CLI, with the router's load-balancing term in the loss;
- ``cluster/slurm.sbatch`` and ``cluster/torchrun.sh``: their launch shape (nodes x processes per node) agrees
  with the command's Trainer, and the command parses with the CLI (``--print_config``, nothing started);
- ``recipe.py`` runs end to end in ``tests/test_recipe.py`` (two processes).
"""
from __future__ import annotations

import math
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import load_example

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.cli import AsyncPipelineCLI

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ROOT = EXAMPLES.parent


@pytest.fixture(autouse=True)
def no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-async-pp"])


def test_every_example_is_covered_here_or_by_the_recipe_test():
    covered = {"own_model.py", "moe.yaml", "recipe.py", "cluster/slurm.sbatch", "cluster/torchrun.sh",
               "cluster/smollm_360m_2bw.yaml"}
    assert {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*") if p.is_file()} == covered


@pytest.mark.slow
def test_own_model_example_trains_with_2bw_on_one_device_as_two_stages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example = load_example("own_model")
    trainer = example.main(["--devices", "1", "--num-stages", "2", "--max-steps", "3", "--max-bytes", "60000",
                            "--root", str(tmp_path)])
    assert trainer.global_step == 3 and isinstance(trainer.strategy, AsyncPipelineStrategy)
    assert trainer.strategy.num_stages == 2 and trainer.strategy.schedule == "2bw"
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))
    # The model's parts are the pipeline's layers: embedding, 4 blocks, head; every parameter in one of them.
    model = trainer.lightning_module
    layers = model.pipeline_layers()
    assert len(layers) == 6
    assert {id(p) for layer in layers for p in layer.parameters()} == {id(p) for p in model.parameters()}


@pytest.mark.hf
@pytest.mark.slow
def test_moe_example_trains_a_mixtral_on_the_loss_with_the_router_term(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((EXAMPLES / "moe.yaml").read_text())
    assert config["model"]["init_args"]["config"]["output_router_logits"] is True
    # Tiny: one device emulating the two stages, two steps, a small slice of the corpus.
    config["trainer"].update(devices=1, max_steps=2, val_check_interval=2, limit_val_batches=2, log_every_n_steps=1)
    config["trainer"]["strategy"]["init_args"]["num_stages"] = 2
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["trainer"]["callbacks"][0]["init_args"]["schedule_image_every_n_steps"] = 2
    config["data"].update(max_bytes=60_000, block_size=32, batch_size=8, cache_dir=str(tmp_path / "cache"))
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = AsyncPipelineCLI(args=["fit", "--config", str(path)])
    assert cli.trainer.global_step == 2
    aux = float(cli.trainer.callback_metrics["train_aux_loss"])
    # Mixtral's balancing term is num_experts x sum_e f_e P_e >= 1 with equality at perfect balance (f = P = 1/E).
    assert math.isfinite(aux) and aux >= 1.0 - 1e-5
    assert torch.isfinite(cli.trainer.callback_metrics["val_loss"])
    (monitor,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "PipelineMonitor"]
    assert monitor.schedule_steps == [1]  # the picture of step 1 ((1 + 1) % 2 == 0)


def launched(script: Path) -> list[str]:
    """The ``lightning-async-pp`` / ``lightning_async_pp.cli`` arguments of a launcher script (after ``fit``)."""
    text = script.read_text().replace("\\\n", " ")
    commands = [ln for ln in text.splitlines() if not ln.startswith("#")]
    (line,) = [ln for ln in commands if "lightning-async-pp fit" in ln or "lightning_async_pp.cli" in ln]
    words = shlex.split(line)
    return words[words.index("fit"):]


def print_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_:
        AsyncPipelineCLI(args=[a for a in args if a not in ("--ckpt_path", "last")] + ["--print_config"])
    assert exit_.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def check_shape(printed: dict, nodes: int, per_node: int) -> None:
    trainer, strategy = printed["trainer"], printed["trainer"]["strategy"]["init_args"]
    assert (int(trainer["num_nodes"]), int(trainer["devices"])) == (nodes, per_node)  # devices: "4" from the CLI
    stages = nodes * per_node // strategy.get("data_parallel_size", 1)
    assert strategy["num_microbatches"] >= stages  # 2BW needs at least one microbatch per stage
    assert printed["data"]["batch_size"] % strategy["num_microbatches"] == 0
    model = printed["model"]["init_args"]
    assert model["size"] == "smollm-360m" and 32 + 2 >= stages  # 32 blocks, embedding and head: enough layers


def test_slurm_script_launches_one_task_per_gpu_with_the_requeue_signal_and_parses(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the script runs from the repository's root
    script = EXAMPLES / "cluster" / "slurm.sbatch"
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", script.read_text(), re.M))
    nodes, tasks, gpus = int(sbatch["nodes"]), int(sbatch["ntasks-per-node"]), int(sbatch["gpus-per-node"])
    assert tasks == gpus and sbatch["signal"] == "USR1@90"
    assert "srun lightning-async-pp fit" in script.read_text()
    check_shape(print_config(launched(script), capsys), nodes, tasks)


def test_torchrun_script_starts_the_trainers_processes_per_node_and_parses(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    script = EXAMPLES / "cluster" / "torchrun.sh"
    (line,) = [ln for ln in script.read_text().replace("\\\n", " ").splitlines() if ln.startswith("torchrun ")]
    command = shlex.split(line)
    options = dict(zip(command[1:command.index("-m"):2], command[2:command.index("-m"):2]))
    assert options["--rdzv-backend"] == "c10d" and int(options["--max-restarts"]) >= 1
    args = launched(script)
    assert args[-2:] == ["--ckpt_path", "last"]  # a restarted job resumes
    check_shape(print_config(args, capsys), int(options["--nnodes"]), int(options["--nproc-per-node"]))
