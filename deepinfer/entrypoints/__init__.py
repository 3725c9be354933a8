"""The user-facing entry points, above the core: the offline API (`llm.py`), the
command line (`cli/`) and the registry of executors by name (`executor_registry.py`).

The core below (every other module of `deepinfer/`) imports neither the simulator
(`sim`), the torch executor (`executors`) nor the kernels (`kernels`), at any level:
these modules choose an executor, build it and hand it down (`EngineCore` takes an
executor object). `tests/core/test_layering.py` checks both.
"""
