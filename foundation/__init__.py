"""The foundation: what the stages, the trainer and the pipeline all build on, importing none
of them (parameters and their validators, storage, versions, the bounded heap, model loading, the
shard layout, the image transform). Layers, bottom to top: ``schemas`` (the columns, which the
shard layout names), ``foundation``, ``stages`` and ``trainer``, ``pipeline``. ``pyproject.toml``'s ``[tool.importlinter]`` pins them
(``tests/test_layers.py``)."""
