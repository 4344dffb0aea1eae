"""Turn a sharded checkpoint into one Lightning checkpoint file (the newest weights and everything else), or into
the upstream library's folder.

    python -m lightning_async_pp.consolidate SRC DST
    python -m lightning_async_pp.consolidate SRC DST --hf [--tokenizer PATH]
    python -m lightning_async_pp.consolidate SRC DST --litgpt [--tokenizer PATH]

The first mirrors Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint``.
``MyModel.load_from_checkpoint(DST)`` then loads the weights without any strategy, and
``Trainer(strategy=AsyncPipelineStrategy(...)).fit(ckpt_path=DST)`` resumes in any layout. ``--hf`` (a
``HuggingFaceCausalLM`` run) writes a ``save_pretrained`` folder DST for ``AutoModelForCausalLM.from_pretrained(DST)``;
``--litgpt`` (a ``LitGPT`` run) a litgpt checkpoint folder; both take the tokenizer's files from ``--tokenizer`` or
from what the run names (see ``lightning_async_pp/export.py``), and also take a single-file checkpoint as SRC. Runs
in one process, without a process group; it needs memory for the whole checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
from typing import Any, Optional, Sequence

from lightning_async_pp import checkpoint as _checkpoint


def consolidate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> dict[str, Any]:
    """Write the sharded checkpoint directory ``src`` as one file ``dst``; returns the checkpoint dict."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not _checkpoint.is_sharded(src):
        raise ValueError(f"{src!r} is not a sharded checkpoint directory (one written with save_distributed_checkpoint=True)")
    if os.path.isdir(dst):
        raise ValueError(f"{dst!r} is a directory; give the path of the file to write")
    return _checkpoint.consolidate(src, dst)


def main(argv: Optional[Sequence[str]] = None) -> int:
    # The module's docstring: its first paragraph as the description, the rest (usage and what each form writes) after
    # the options, line breaks kept.
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(prog="python -m lightning_async_pp.consolidate",
                                     description=textwrap.fill(" ".join(summary.split()), 100),
                                     epilog=details.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", help="a sharded checkpoint directory")
    parser.add_argument("dst", help="the checkpoint file to write (with --hf or --litgpt: the folder)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--hf", action="store_true", help="write a Hugging Face save_pretrained folder")
    kind.add_argument("--litgpt", action="store_true", help="write a litgpt checkpoint folder")
    parser.add_argument("--tokenizer", help="a tokenizer folder or tokenizer.json to copy into the folder (--hf, --litgpt)")
    args = parser.parse_args(argv)
    if args.tokenizer and not (args.hf or args.litgpt):
        parser.error("--tokenizer goes with --hf or --litgpt")
    try:
        if args.hf or args.litgpt:
            from lightning_async_pp import export

            files = (export.export_hf if args.hf else export.export_litgpt)(args.src, args.dst, tokenizer=args.tokenizer)
            print(f"wrote {args.dst}: {', '.join(files)}")
            return 0
        checkpoint = consolidate_checkpoint(args.src, args.dst)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    print(f"wrote {args.dst}: {len(checkpoint['state_dict'])} tensors in state_dict, "
          f"{checkpoint['async_pipeline'].get('num_updates')} updates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
