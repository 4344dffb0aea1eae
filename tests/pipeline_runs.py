"""Running the multi-process script and the one-device reference the multi-process tests compare against."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import launcher
from helpers import TinyLM, make_dataset
from lightning_async_pp import AsyncPipelineStrategy

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_fit.py"


def run_multiprocess(cfg: dict, tmp_path: Path, timeout: float = 240, launch: str = "at_once") -> subprocess.CompletedProcess:
    out = tmp_path / "final.pt"
    return run_ranks([sys.executable, str(SCRIPT), "--config", json.dumps(cfg), "--out", str(out)],
                     cfg["stages"] * cfg.get("dp", 1), tmp_path, rank_env(), timeout, launch)


def rank_env(**extra: str) -> dict:
    """This process's environment less its rendezvous and seed variables, for a script's ranks: one environment
    for every launch, so that they all share tests/launcher.py's server."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    return env


def run_ranks(cmd: list[str], processes: int, cwd: Path, env: dict, timeout: float,
              launch: str = "at_once") -> subprocess.CompletedProcess:
    """A script whose ``Trainer`` has ``devices=processes``, on one machine.

    ``launch="lightning"``: started once, and Lightning's launcher starts ranks 1.. by running the script again
    when rank 0 reaches ``fit`` (what ``python train.py`` does). ``"at_once"``: every rank started together with
    its rendezvous variables, as ``torchrun`` starts them (Lightning then starts no process), forked from a server
    that has imported torch and the like (tests/launcher.py; ``LIGHTNING_ASYNC_PP_TEST_FORK=0``: fresh
    interpreters, whose imports, about 10 s of each process's start here, at least overlap). The ranks' outputs
    are joined in rank order, the return code is the first rank's that failed."""
    if launch == "lightning" or processes == 1:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if launch != "at_once":
        raise ValueError(f"launch={launch!r}; use 'at_once' or 'lightning'")
    port = free_port()
    with tempfile.TemporaryDirectory() as logs:
        # Files, not pipes: a rank blocked on a full pipe nobody reads yet would hold up the others.
        files = [(os.path.join(logs, f"{rank}.out"), os.path.join(logs, f"{rank}.err")) for rank in range(processes)]
        procs = [launcher.start(cmd, cwd, dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                               WORLD_SIZE=str(processes), NODE_RANK="0", LOCAL_RANK=str(rank)),
                                *files[rank])
                 for rank in range(processes)]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for proc in procs:
                proc.kill()
            for proc in procs:
                proc.wait()
            raise subprocess.TimeoutExpired(cmd, timeout) from None
        texts = [[Path(f).read_text(errors="replace") for f in pair] for pair in files]
    failed = [proc.returncode for proc in procs if proc.returncode != 0]
    # A failed run's stderr names each rank's part and exit code (a rank killed by a signal has a negative one).
    label = (lambda r: f"\n---- rank {r} (exit code {procs[r].returncode}) ----\n") if failed else (lambda r: "")
    return subprocess.CompletedProcess(cmd, failed[0] if failed else 0, "".join(t[0] for t in texts),
                                       "".join(label(r) + t[1] for r, t in enumerate(texts)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multiprocess_weights(cfg: dict, tmp_path: Path, launch: str = "at_once") -> dict[str, torch.Tensor]:
    proc = run_multiprocess(cfg, tmp_path, launch=launch)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(tmp_path / "final.pt")


def one_device_weights(cfg: dict, batch: int | None = None, strategy: bool = True, **strategy_kwargs) -> dict[str, torch.Tensor]:
    """The same run on one device (all stages in one process), or with no strategy at all."""
    torch.manual_seed(0)
    model = TinyLM(**cfg.get("model", {}), optimizer=cfg.get("optimizer", "sgd"))
    kwargs = dict(accelerator="cpu", devices=1, max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  gradient_clip_val=cfg.get("clip"))
    if strategy:
        kwargs["strategy"] = AsyncPipelineStrategy(
            schedule=cfg["schedule"], num_microbatches=cfg["microbatches"] * cfg.get("dp", 1), **strategy_kwargs
        )
    loader = DataLoader(make_dataset(cfg.get("samples", 64)), batch_size=batch or cfg["batch"], shuffle=False, drop_last=True)
    L.Trainer(**kwargs).fit(model, loader)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


#: float32's unit roundoff bound (2^-23): one rounding moves a value by at most this much of it.
FLOAT32_EPS = torch.finfo(torch.float32).eps


def sgd_step_bounds(weights: dict[str, torch.Tensor], gradients: dict[str, torch.Tensor], lr: float,
                    accumulations: int) -> dict[str, float]:
    """How far two float32 computations of one SGD step ``w - lr * g`` from the same weights may land apart, per
    tensor, whatever the CPU's kernels: each gradient is a sum along chains of at most ``accumulations`` additions,
    so each run's rounding moves it by at most ``accumulations * eps`` of its scale (taken as the tensor's largest
    gradient), and each run rounds the new weight once (``eps`` of the weight); two runs, twice that."""
    return {k: 2 * FLOAT32_EPS * (lr * accumulations * float(gradients[k].abs().max()) + float(weights[k].abs().max()))
            for k in gradients}


#: The learning rate of :func:`sgd_model`: the update is the gradient.
SGD_LR = 1.0


def sgd_model(model_class: type) -> type:
    """``model_class`` trained by plain SGD at :data:`SGD_LR`, to check a pipeline's update against an upstream
    gradient: well conditioned, where AdamW's first step (``lr * g / (|g| + eps)``, about ``lr * sign(g)``) hides the
    gradient's scale and turns the float32 rounding of a gradient near its ``eps`` into differences of up to ``lr``
    (on one CPU below a fixed bound, on another above it)."""

    class SGDModel(model_class):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=SGD_LR)

    SGDModel.__name__ = SGDModel.__qualname__ = f"SGD{model_class.__name__}"
    return SGDModel


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
               "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def run_script(script: Path, cfg: dict, tmp_path: Path, timeout: float = 240, launch: str = "at_once") -> subprocess.CompletedProcess:
    """Run a tests/scripts/ script (``helpers.script_main``), which saves each rank's result in ``tmp_path/out``."""
    return run_ranks([sys.executable, str(script), "--config", json.dumps(cfg), "--out", str(tmp_path / "out")],
                     cfg.get("devices", 2), tmp_path, rank_env(), timeout, launch)


def script_ranks(script: Path, cfg: dict, tmp_path: Path, ranks: int = 2, timeout: float = 240) -> list[dict]:
    """Run a tests/scripts/ script on its processes; what each rank saw, rank 0 first."""
    proc = run_script(script, cfg, tmp_path, timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def run_here_on_one_device(run, cfg: dict) -> dict:
    """A script's ``run(cfg, devices=1)`` in this process, leaving the seed variables Lightning sets as they were."""
    saved = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")}
    try:
        result, _, _ = run(cfg, devices=1)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return result


def whole_tensor_parallel_model(ranks: list[dict], case: str, tie: tuple[str, str]) -> dict[str, torch.Tensor]:
    """A 2 stages x 2 tensor-parallel ranks run's weights, from tensor-parallel rank 0 of each stage (ranks 0 and 2,
    each returning its stage's parameters whole as "stage_weights"), by state-dict name; ``tie``: (head, embedding)
    names of the tied matrix, one parameter listed once under the embedding's."""
    merged: dict[str, torch.Tensor] = {}
    for r in (0, 2):
        merged.update(ranks[r]["cases"][case]["stage_weights"])
    merged.setdefault(tie[0], merged[tie[1]])
    return merged
