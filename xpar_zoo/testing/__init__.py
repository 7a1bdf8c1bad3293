"""The test harness, public for users who prove their own plans and architectures as the zoo proves its own.

- :mod:`~xpar_zoo.testing.launch`: ``run(fn, world, *args)`` runs ``fn`` on ``world`` local gloo ranks (spawned
  processes, or forked from one fork server) and returns rank 0's result; a failing or dying rank fails the call
  with its traceback.
- :mod:`~xpar_zoo.testing.parity`: tiny transformers models, data with unequal valid targets per rank, the
  single-process reference run, the parallel run, and the comparison with its tolerances (the one source of truth
  for "equals single-process transformers"), plus the memory measures the tests and benchmarks use.
- :mod:`~xpar_zoo.testing.proofs`: the meshes each architecture of the zoo is proved on, the tiny configs (and
  refused plans, inputs) of the automatically planned types, and the MoE families of the pinned transformers
  (tests/distributed/test_zoo.py, ``xpar-zoo list`` and MODEL_CARDS.md read them).
- :mod:`~xpar_zoo.testing.modality`: image inputs of the tiny multimodal configs, one micro-batch per rank.
"""
