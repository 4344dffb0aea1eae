"""Turn a sharded checkpoint into one Lightning checkpoint file (the newest weights and everything else).

    python -m lightning_async_pp.consolidate SRC DST

mirrors Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint``. ``MyModel.load_from_checkpoint(DST)``
then loads the weights without any strategy, and ``Trainer(strategy=AsyncPipelineStrategy(...)).fit(ckpt_path=DST)``
resumes in any layout. Runs in one process, without a process group; it needs memory for the whole checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

from lightning_async_pp.pipeline import checkpoint as _checkpoint


def consolidate_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> dict[str, Any]:
    """Write the sharded checkpoint directory ``src`` as one file ``dst``; returns the checkpoint dict."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not _checkpoint.is_sharded(src):
        raise ValueError(f"{src!r} is not a sharded checkpoint directory (one written with save_distributed_checkpoint=True)")
    if os.path.isdir(dst):
        raise ValueError(f"{dst!r} is a directory; give the path of the file to write")
    return _checkpoint.consolidate(src, dst)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_async_pp.consolidate", description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a sharded checkpoint directory")
    parser.add_argument("dst", help="the checkpoint file to write")
    args = parser.parse_args(argv)
    try:
        checkpoint = consolidate_checkpoint(args.src, args.dst)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.dst}: {len(checkpoint['state_dict'])} tensors in state_dict, "
          f"{checkpoint['async_pipeline'].get('num_updates')} updates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
