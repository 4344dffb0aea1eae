"""The documentation site (mkdocs.yml, docs/) tells the truth about the code.

- every public name (each package's ``__all__``, and the Python entry point of each command) has its entry in the
  API reference pages, and every entry the pages generate resolves to an object (a renamed name fails here
  before ``mkdocs build --strict`` fails on it);
- every page is in the site's navigation;
- commands quoted in the pages that are cheap to run are run, and what the page says they print is compared;
- the guide's Trainer examples (monitoring, the quick start's own model) run as shown on one device and on two
  processes (tests/scripts/guide_fit.py);
- README.md is a front page: the two quick-start commands, links into the site that resolve; links between pages
  reach a page and, with an anchor, one of its headings;
- every page is read in one sitting: at most 25 KB (the generated family table and the delay study's record aside).
"""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ["lightning_async_pp", "lightning_async_pp.callbacks", "lightning_async_pp.data",
            "lightning_async_pp.models", "lightning_async_pp.optim"]
#: What the commands and DESIGN's public names run, beside the packages' __all__.
ENTRY_POINTS = [
    "lightning_async_pp.cli.AsyncPipelineCLI",                  # lightning-async-pp
    "lightning_async_pp.consolidate.consolidate_checkpoint",    # python -m lightning_async_pp.consolidate
    "lightning_async_pp.export.export_hf",                      # ... --hf
    "lightning_async_pp.export.export_litgpt",                  # ... --litgpt
    "lightning_async_pp.data.prepare.prepare",                  # python -m lightning_async_pp.data.prepare
    "lightning_async_pp.plan",                                  # lightning-async-pp-plan
    "lightning_async_pp.pipeline.simulate.simulate",            # the planner from Python
    "lightning_async_pp.pipeline.simulate.SimulationResult",
    "lightning_async_pp.trace.schedule_figure",
]


def reference_entries() -> list[str]:
    return [m.group(1) for page in sorted((DOCS / "reference").glob("*.md"))
            for m in re.finditer(r"^::: ([\w.]+)", page.read_text(), re.M)]


def resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def public_names() -> list[str]:
    names = [f"{package}.{name}" for package in PACKAGES for name in importlib.import_module(package).__all__]
    return names + ENTRY_POINTS


def test_every_public_name_has_an_entry_in_the_api_reference():
    entries = set(reference_entries())
    missing = [name for name in public_names() if name not in entries]
    assert not missing, f"add to docs/reference/*.md: {missing}"


def test_every_reference_entry_resolves_to_an_object():
    for entry in reference_entries():
        resolve(entry)  # raises, naming the entry, when a name was renamed or removed


def nav_pages(nav) -> list[str]:
    pages = []
    for item in nav:
        values = item.values() if isinstance(item, dict) else [item]
        for value in values:
            pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_is_in_the_navigation_and_every_navigation_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = nav_pages(config["nav"])
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert set(nav) == pages, (set(nav) ^ pages)


def test_every_picture_in_the_pages_exists():
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text()):
            assert (page.parent / target).resolve().is_file(), (page, target)


def test_the_planning_pages_command_prints_its_table_and_draws_its_figures(tmp_path, capsys):
    from lightning_async_pp.plan import main

    page = (DOCS / "guide" / "planning.md").read_text()
    section = page.split("## The plan as a picture", 1)[1]
    command = re.search(r"```bash\n(lightning-async-pp-plan .*?)\n```", section, re.S).group(1)
    argv = shlex.split(command)[1:]
    figure = argv.index("--figure") + 1
    assert argv[figure] == "docs/images/plan.png"
    argv[figure] = str(tmp_path / "plan.png")
    main(argv)
    printed = capsys.readouterr().out
    table = [line for line in section.splitlines() if line.startswith("| 4 | 8 |")]
    assert len(table) == 2 and all(row in printed for row in table), printed
    drawn = sorted(p.name for p in tmp_path.glob("*.png"))
    assert drawn == ["plan-1f1b-p4-m8.png", "plan-2bw-p4-m8.png"]
    for name in drawn:
        assert f"../images/{name}" in section and (DOCS / "images" / name).is_file()


def test_the_readme_is_a_front_page_with_the_quick_start_and_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) < 12_000
    assert "make demo" in readme and "make test" in readme
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not link.startswith("http")]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        assert (ROOT / link).exists(), link


def heading_anchor(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` gives a heading: markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", re.sub(r"[`*]", "", heading.strip().lower()))
    return re.sub(r" +", "-", re.sub(r"[^\w\- ]", "", text).strip())


def test_every_link_between_pages_reaches_a_page_and_its_heading():
    # `make test` catches a moved page before `mkdocs build --strict` does in CI (a link to the removed
    # single design page, since split under docs/design/, once failed only there).
    broken = []
    for page in DOCS.rglob("*.md"):
        for target in re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http:", "https:", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            if not dest.is_file():
                broken.append((str(page.relative_to(DOCS)), target, "no such page"))
            elif anchor and dest.suffix == ".md":
                headings = {heading_anchor(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in headings:
                    broken.append((str(page.relative_to(DOCS)), target, "no such heading"))
    assert not broken, broken


@pytest.mark.parametrize("page", sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")))
def test_paths_named_in_the_pages_exist(page):
    text = (DOCS / page).read_text()
    for path in set(re.findall(r"`((?:examples|studies|configs|benchmarks|tests)/[\w./-]+\.(?:py|yaml|sbatch|sh))`", text)):
        assert (ROOT / path).exists(), (page, path)


# ---- the guide's Trainer examples run as shown, on one device and across processes -----------------------------
@pytest.mark.multiprocess
def test_the_guides_trainer_examples_run_as_shown_on_one_and_two_processes_to_the_one_device_weights(tmp_path):
    """Each page's ``L.Trainer(...)`` example (tests/scripts/guide_fit.py: the monitoring pages', the quick start's
    own model) on one device and on two processes; the monitors log their figures, and the weights are those of
    the same run without the monitors on one device, the stages in one process (the rule two processes follow)."""
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from guide_fit import PAGES, run
    from pipeline_runs import max_difference, run_here_on_one_device, script_ranks

    import torch

    pages = sorted(PAGES)
    # One thread, as each of the processes runs: with two, matmuls round differently in the last bits, which the
    # quick start's Muon (Newton-Schulz) amplifies to 6e-4 in 3 steps.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = run_here_on_one_device(run, dict(pages=pages, callbacks=False, num_stages=2))
        one = run_here_on_one_device(run, dict(pages=pages))
    finally:
        torch.set_num_threads(threads)
    two = script_ranks(ROOT / "tests" / "scripts" / "guide_fit.py", dict(pages=pages, devices=2), tmp_path)[0]
    for page in pages:
        if "monitoring" in page:
            for result in (one[page], two[page]):
                assert {"staleness/drift", "pipeline/bubble_fraction"} <= set(result["metrics"]), (page, result["metrics"])
        assert max_difference(two[page]["state_dict"], reference[page]["state_dict"]) <= 1e-5, page


@pytest.mark.hf
def test_the_export_pages_logits_check_runs_as_shown_on_a_trained_checkpoint(tmp_path, monkeypatch):
    """docs/guide/data.md, "Check the exported model against the trained one": its example, run as written on a
    tiny HuggingFaceCausalLM trained two steps (a sharded checkpoint) and exported with ``consolidate --hf``."""
    import sys

    pytest.importorskip("transformers")
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from adapter_fit import build_model, run
    from pipeline_runs import run_here_on_one_device

    from lightning_async_pp.consolidate import main as consolidate

    monkeypatch.chdir(tmp_path)
    run_here_on_one_device(run, dict(checkpoint_dir="checkpoints", steps=2))
    assert consolidate(["checkpoints/epoch=0-step=2.ckpt", "my-model", "--hf"]) == 0
    section = (DOCS / "guide" / "data.md").read_text().split("### Check the exported model against the trained one")[1]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert example.count("checkpoints/epoch=0-step=2000.ckpt") == 1
    namespace: dict = {}
    exec(compile(example.replace("step=2000", "step=2"), "docs/guide/data.md", "exec"), namespace)
    # What it compared is the trained model: the two updates moved the weights away from the initialization.
    initial = build_model({})
    initial.configure_model()
    trained = namespace["trained"].state_dict()
    assert max(float((trained[k] - v).abs().max()) for k, v in initial.state_dict().items()) > 1e-4
    assert torch.equal(namespace["exported"].state_dict()["model.norm.weight"], trained["model.norm.weight"])


def page_values(page: str, namespace: dict) -> list:
    """The value of every expression statement of the page's Python blocks, run in order in ``namespace``."""
    import ast

    values = []
    for block in re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S):
        for node in ast.parse(block).body:
            if isinstance(node, ast.Expr):
                values.append(eval(compile(ast.Expression(node.value), page, "eval"), namespace))
            else:
                exec(compile(ast.Module([node], []), page, "exec"), namespace)
    return values


def test_the_optimizer_and_strategy_fragments_of_the_guide_build_what_they_name():
    """docs/guide/optimizers.md and gpus.md show constructors alone: each builds, for the optimizers over every
    parameter of a model once (the quick start's, in the namespace as ``model``)."""
    import torch
    from torch import nn

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.optim import ErrorFeedback, Muon

    class Model(nn.Module):  # embedding, hidden matrices, head, biases: both of Muon's parts get parameters
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.hidden, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 16)

    model = Model()
    optimizers = page_values("guide/optimizers.md", {"model": model, "torch": torch})
    assert [type(o) for o in optimizers] == [Muon, ErrorFeedback, ErrorFeedback]
    for optimizer in optimizers:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert len(params) == len({id(p) for p in params}) and {id(p) for p in params} == {id(p) for p in model.parameters()}
    strategies = page_values("guide/gpus.md", {"AsyncPipelineStrategy": AsyncPipelineStrategy})
    assert [type(s) for s in strategies] == [AsyncPipelineStrategy] * 2


def test_the_data_guides_tokenizer_training_runs_as_shown_and_the_data_reads_with_its_tokenizer(tmp_path, monkeypatch):
    """docs/guide/data.md, "Train a tokenizer on your corpus": its Python blocks and its prepare command, run as
    written on a small corpus of text files; the data module and the prepared folder hold that tokenizer's ids, each
    document ended by its end-of-text token."""
    import json

    from tokenizers import Tokenizer

    from lightning_async_pp.data import TextDataModule
    from lightning_async_pp.data.prepare import main as prepare_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    words = "pipeline stage weight version gradient activation microbatch update delay bound".split()
    for f in range(3):
        (tmp_path / "corpus" / f"part{f}.txt").write_text(
            "".join(" ".join(words[(f + i * j) % len(words)] for j in range(12)) + ".\n" for i in range(400)))
    section = (DOCS / "guide" / "data.md").read_text().split("### Train a tokenizer on your corpus")[1].split("\n## ")[0]
    namespace: dict = {}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        exec(compile(block, "docs/guide/data.md", "exec"), namespace)
    tokenizer = Tokenizer.from_file("my-tokenizer/tokenizer.json")
    data, eos = namespace["data"], tokenizer.token_to_id("<|endoftext|>")
    assert namespace["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True) < 8192  # a small corpus
    data.setup("fit")
    assert data.document_end() == eos
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (data.batch_size, 257) and int(batch.max()) < namespace["vocab_size"]
    text = tokenizer.decode(batch[0].tolist())
    assert any(w in text for w in words)
    (command,) = re.findall(r"```bash\n(python -m lightning_async_pp\.data\.prepare .*?)\n```", section)
    prepare_main(shlex.split(command)[3:])
    info = json.loads((tmp_path / "data" / "tokens" / "COMPLETE.json").read_text())
    assert (info["eos_id"], info["vocab_size"]) == (eos, namespace["vocab_size"])
    prepared = TextDataModule(data_path="data/tokens", block_size=256)  # it carries the tokenizer
    assert (prepared.vocab_size, prepared.document_end()) == (namespace["vocab_size"], eos)


#: Pages that are generated or hold a study's whole record: as long as what they record.
LONG_PAGES = {"docs/models.md", "docs/delay-study.md"}


def test_every_page_is_at_most_25_kb():
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted(DOCS.rglob("*.md"))]
    big = {str(p.relative_to(ROOT)): p.stat().st_size for p in pages
           if str(p.relative_to(ROOT)) not in LONG_PAGES and p.stat().st_size > 25_000}
    assert not big, f"pages past 25 KB (split a note by concern; superseded figures go to docs/benchmarks-archive.md): {big}"
