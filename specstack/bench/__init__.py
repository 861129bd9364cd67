"""``specstack bench``: the comparison harness.

    from specstack.bench import Grid, run_grid

    table = run_grid(Grid(stacks=["triforce", "retrieval-flat"], budgets=[256, 512], context_lengths=[2048]), out="results/x")
    print(table.to_markdown())

A :class:`Grid` crosses stacks (registered recipes and the ``hf-*`` transformers baselines) with
option axes and task axes; every run is one JSON record in ``out/results.jsonl`` (resumable), and
``results.csv``, ``report.md`` and plots are rebuilt from all records. See docs/bench.md.
"""

from .grid import Grid, Point, expand, load_grid
from .harness import Table, run_grid, write_outputs
from .models import ByteTokenizer, DefaultModels, Models, SyntheticModels
from .stacks import BASELINES, Catalog
from .tasks import TASKS, Prompt, Task

__all__ = [
    "BASELINES", "ByteTokenizer", "Catalog", "DefaultModels", "Grid", "Models", "Point", "Prompt", "SyntheticModels", "TASKS",
    "Table", "Task", "expand", "load_grid", "run_grid", "write_outputs",
]
