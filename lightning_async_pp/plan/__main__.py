"""``python -m lightning_async_pp.plan``: the ``lightning-async-pp-plan`` command."""
import sys

from lightning_async_pp.plan.cli import main

main(sys.argv[1:])
