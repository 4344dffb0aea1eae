"""Records the ``torch.distributed`` traffic of every Python process started with this folder on ``PYTHONPATH``
and ``LIGHTNING_ASYNC_PP_TRAFFIC`` naming a directory (tests/conftest.py sets both for multi-process tests).

The recorder (tests/traffic.py) is installed when ``torch.distributed.distributed_c10d`` is first imported; torch
is not imported here, most subprocesses never use it. Another ``sitecustomize`` later on ``sys.path`` (this one
shadows it) is run afterwards.
"""
import importlib.machinery
import importlib.util
import os
import sys


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _install():
    directory = os.environ.get("LIGHTNING_ASYNC_PP_TRAFFIC")
    if not directory:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    # A private module name: the tests folder is not put on sys.path (its modules would shadow others).
    traffic = _load("_lightning_async_pp_traffic", os.path.join(os.path.dirname(here), "traffic.py"))
    traffic.install_when_imported(directory, os.environ.get("LIGHTNING_ASYNC_PP_STRICT_TAGS", "0") == "1")


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.origin and os.path.abspath(spec.origin) != os.path.abspath(__file__):
        _load("_sitecustomize_shadowed", spec.origin)


_install()
_chain()
