"""``specstack bench``: the comparison harness.

    from specstack.bench import Grid, run_grid

    table = run_grid(Grid(stacks=["triforce", "retrieval-flat"], budgets=[256, 512], context_lengths=[2048]), out="results/x")
    print(table.to_markdown())

A :class:`Grid` crosses stacks (registered recipes and the ``hf-*`` transformers baselines) with
option axes and task axes; every run is one JSON record in ``out/results.jsonl`` (resumable), and
``results.csv``, ``report.md`` and plots are rebuilt from all records. See docs/bench.md.
"""

from importlib import import_module

# name -> the submodule that defines it; imported on first use, so that ``specstack bench``'s parser (and
# ``specstack --help``) does not pay for the harness's imports (transformers, through specstack.hf)
_EXPORTS = {
    "Grid": "grid", "Point": "grid", "expand": "grid", "load_grid": "grid",
    "Table": "harness", "run_grid": "harness", "write_outputs": "harness",
    "ByteTokenizer": "models", "DefaultModels": "models", "Models": "models", "SyntheticModels": "models",
    "BASELINES": "stacks", "Catalog": "stacks",
    "TASKS": "tasks", "Prompt": "tasks", "Task": "tasks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
