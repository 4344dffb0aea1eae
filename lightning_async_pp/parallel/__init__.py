"""The parallel dimensions beside the pipeline, one module per dimension over one device mesh.

The pipeline's own dimension (stages, the schedule, the messages between them) is the engine's, in
:mod:`lightning_async_pp.pipeline`; what sits beside it here:

- ``mesh.py``: the layout of data parallel x stages x tensor parallel over the processes and its ``DeviceMesh``
  (dimensions named ``"data_parallel"``, ``"pipeline"``, ``"tensor_parallel"``); ``topology.py``: rank <-> (stage,
  replica) and the data-parallel groups;
- ``data_parallel.py``: a stage's gradient reduced over its replicas (bucketed, in place, overlapped);
- ``zero.py``: ZeRO-1, a stage's optimizer state sharded over its replicas (``shard_optimizer=True``);
- ``tensor_parallel.py``: DTensor parameters in the engine (local shards kept, whole values where one device's
  numbers are needed);
- ``placement.py``: where a stage's layers and their shards live (other stages' layers out of the tree, on
  ``meta``, and back; meta layers materialized).

A new dimension is a new module here that takes its process groups from the mesh (a named dimension of
``mesh.py``'s layout) and touches the engine only through the hooks the existing ones use (the gradient hand-over,
the optimizer, the checkpoint's global names), as ``expert.py`` does: expert parallelism, the ``e`` ranks of an
expert group drawn from one stage's data-parallel ranks (``e`` divides their number, no extra processes), each
holding whole experts of the stage's MoE layers under their global indices, tokens exchanged by all-to-all
(docs/design/expert-parallel.md).

Nothing here imports Lightning or the engine's runtime (tests/test_layout.py).
"""
