"""Token-tree shapes: which draft node gets how many children.

A :class:`TreeShape` is a tuple of parents in topological order (-1: a child of the last committed
token, else an earlier node), siblings in the order they are drawn and tried. It is written as a
spec string on the command line and in grids::

    chain:4          one child per node, 4 deep
    star:8           8 children of the root, depth 1
    binary:3         two children per node, 3 deep (2 + 4 + 8 = 14 nodes)
    widths:4,2,1     the root has 4 children, each depth-0 node 2, each depth-1 node 1 (4 + 8 + 8 nodes)
    parents:-1,0,0   any tree, by its parents

``/`` may replace ``,`` (``widths:4/2/1``), which keeps a spec inside ``stack:key=value,…`` intact.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import attrs

from specstack import SpecstackError

MAX_NODES = 4096  # a larger tree would not fit any level's speculative slots
FORMS = "chain:D, star:W, binary:D, widths:W0,W1,… (integers >= 1) or parents:-1,0,… (each -1 or an earlier index)"


def _parents(value: Iterable[int]) -> tuple[int, ...]:
    try:
        return tuple(_integer(p) for p in value)
    except (TypeError, ValueError):
        raise SpecstackError(f"tree parents {value!r} are not allowed; use a sequence of integers") from None


def _integer(value) -> int:
    if isinstance(value, bool) or int(value) != value:
        raise ValueError(value)
    return int(value)


def _check(instance, attribute, parents: tuple[int, ...]) -> None:
    if not parents:
        raise SpecstackError("an empty tree is not allowed; a tree needs at least one node")
    if len(parents) > MAX_NODES:
        raise SpecstackError(f"a tree of {len(parents)} nodes is not allowed; use at most {MAX_NODES}")
    bad = next((i for i, p in enumerate(parents) if not -1 <= p < i), None)
    if bad is not None:
        raise SpecstackError(f"tree parents {list(parents)} are not allowed: node {bad} has parent {parents[bad]}; each must be -1 or an earlier index")


@attrs.frozen(kw_only=True)
class TreeShape:
    """The shape of a draft token tree: ``parents[i]`` is node i's parent (-1: the root)."""

    parents: tuple[int, ...] = attrs.field(converter=_parents, validator=_check)
    _children: tuple[tuple[int, ...], ...] = attrs.field(init=False, eq=False, repr=False)  # the root's, then each node's

    def __attrs_post_init__(self) -> None:
        children: list[list[int]] = [[] for _ in range(self.size + 1)]
        for i, parent in enumerate(self.parents):
            children[parent + 1].append(i)
        object.__setattr__(self, "_children", tuple(map(tuple, children)))

    # -- constructors ----------------------------------------------------------------------------

    @classmethod
    def from_widths(cls, widths: Sequence[int]) -> "TreeShape":
        """The root has ``widths[0]`` children and every node at depth d has ``widths[d + 1]``
        (breadth-first order, siblings together)."""
        if not widths or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in widths):
            raise SpecstackError(f"tree widths {list(widths)!r} are not allowed; use one or more integers >= 1")
        parents, level = [], [-1]
        for width in widths:
            grown = []
            for parent in level:
                grown += range(len(parents), len(parents) + width)
                parents += [parent] * width
                if len(parents) > MAX_NODES:
                    raise SpecstackError(f"tree widths {list(widths)} are not allowed: more than {MAX_NODES} nodes; use fewer or narrower levels")
            level = grown
        return cls(parents=parents)

    @classmethod
    def chain(cls, depth: int) -> "TreeShape":
        return cls.from_widths([1] * _count("chain depth", depth))

    @classmethod
    def star(cls, width: int) -> "TreeShape":
        return cls.from_widths([_count("star width", width)])

    @classmethod
    def binary(cls, depth: int) -> "TreeShape":
        return cls.from_widths([2] * _count("binary depth", depth))

    @classmethod
    def parse(cls, value: "TreeShape | str | Sequence[int]") -> "TreeShape":
        """A shape from a spec string (see the module docstring), a parents sequence, or a shape."""
        if isinstance(value, TreeShape):
            return value
        if isinstance(value, (list, tuple)):
            return cls(parents=value)
        if not isinstance(value, str):
            raise SpecstackError(f"tree {value!r} is not allowed; use {FORMS}")
        form, sep, rest = value.strip().partition(":")
        numbers = re.split(r"[,/]", rest.strip()) if sep and rest.strip() else []
        try:
            values = [int(n) for n in numbers]
        except ValueError:
            values = None
        build = {"chain": lambda v: cls.chain(*v), "star": lambda v: cls.star(*v), "binary": lambda v: cls.binary(*v),
                 "widths": cls.from_widths, "parents": lambda v: cls(parents=v)}.get(form.strip())
        single = form.strip() in ("chain", "star", "binary")
        if build is None or not values or (single and len(values) != 1):
            raise SpecstackError(f"tree {value!r} is not allowed; use {FORMS}")
        return build(values)

    # -- structure -------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth (0: a child of the root)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(0 if parent < 0 else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        """Levels of draft nodes: the most tokens one path proposes (chain:4 has depth 4)."""
        return max(self.depths) + 1

    def children(self, node: int) -> tuple[int, ...]:
        """Node ``node``'s children (-1: the root's), in the order they are drawn."""
        return self._children[node + 1]

    @property
    def children_per_node(self) -> tuple[int, ...]:
        """The root's number of children, then node 0's, node 1's, …: ``size + 1`` entries."""
        return tuple(map(len, self._children))

    @property
    def nodes_per_depth(self) -> tuple[int, ...]:
        counts = [0] * self.depth
        for depth in self.depths:
            counts[depth] += 1
        return tuple(counts)

    def truncate(self, depth: int) -> "TreeShape":
        """The nodes at depth < ``depth`` (at least 1), renumbered."""
        keep = [i for i, d in enumerate(self.depths) if d < max(depth, 1)]
        index = {old: new for new, old in enumerate(keep)}
        return TreeShape(parents=[index.get(self.parents[i], -1) for i in keep])

    @property
    def spec(self) -> str:
        """The shortest spec string that parses back to this shape."""
        widths, node = [len(self.children(-1))], -1
        for _ in range(self.depth - 1):  # the widths along the first path, if the tree is regular
            node = self.children(node)[0]
            widths.append(len(self.children(node)))
            if widths[-1] == 0:
                break
        if 0 in widths or TreeShape.from_widths(widths) != self:
            return "parents:" + ",".join(map(str, self.parents))
        if len(widths) == 1 and widths[0] > 1:
            return f"star:{widths[0]}"
        if len(set(widths)) == 1 and widths[0] in (1, 2):
            return f"{'chain' if widths[0] == 1 else 'binary'}:{len(widths)}"
        return "widths:" + ",".join(map(str, widths))

    def __str__(self) -> str:
        return self.spec


def _count(what: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpecstackError(f"{what} {value!r} is not allowed; use an integer >= 1")
    return value
