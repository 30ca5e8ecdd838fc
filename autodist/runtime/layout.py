"""One way to lay a model over the world: :class:`Layout`, the object a plan chooses and a user may write by hand.

``parallelize``'s layout keywords (``mp=``, ``pp=``, ``cp=``, ``shard=``, ``checkpoint=``, ``mixed_precision=``)
are its shorthands: ``parallelize(model, loader, layout=Layout(mp=2, shard="parameters"))`` is
``parallelize(model, loader, mp=2, shard="parameters")``. The world is ``dp x cp x pp x mp`` ranks (torchtitan's
``ParallelDims`` is the model): ``dp`` may be left out (None), the ranks the others leave; ``ep`` places a mixture
of experts' experts over ``ep`` of the ``dp`` ranks (it divides them).

Example:
    >>> layout = autodist.Layout(mp=2, shard="parameters", precision="bf16")
    >>> layout.for_world(8)
    Layout(dp=4, mp=2, shard='parameters', checkpoint=False, pp=1, cp=1, precision='bf16', ep=1)
    >>> model, loader = autodist.parallelize(model, loader, layout=layout)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SHARDS = (None, "optimizer", "gradients", "parameters")
PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
DEFAULTS = {"mp": 1, "pp": 1, "cp": 1, "shard": None, "checkpoint": False, "mixed_precision": None, "ep": 1}


def _precision_name(value: Any) -> str | None:
    """"bf16", "fp16" or None from what ``mixed_precision=`` takes (a name or a torch dtype)."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.") if not isinstance(value, str) else value
    if name not in PRECISIONS:
        raise ValueError(f"mixed_precision (a Layout's precision) must be 'bf16', 'fp16', torch.bfloat16 or "
                         f"torch.float16 (the dtype forward and backward compute in; the parameters stay float32) or "
                         f"None, got {value!r}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class Layout:
    """``dp`` data-parallel x ``cp`` context-parallel x ``pp`` pipeline x ``mp`` model-parallel ranks, a ``shard``
    level, checkpointing the blocks or not, and the precision forward and backward compute in.

    Args:
        dp: data-parallel replicas; None: the world's ranks over ``mp x pp x cp``.
        mp / pp / cp: model-parallel degree, pipeline stages, ranks splitting each sequence (``parallelize``'s
            keywords of the same names).
        shard: None, "optimizer", "gradients" or "parameters" (``parallelize``'s ``shard=``).
        checkpoint: recompute each block's activations in backward.
        precision: "bf16" or "fp16": ``parallelize``'s ``mixed_precision=``; None: the model's own dtypes.
        ep: the data-parallel ranks each layer's experts are placed over (``parallelize``'s ``ep=``; it divides
            ``dp``).

    Example:
        >>> model, loader = autodist.parallelize(model, loader, layout=autodist.Layout(pp=2, checkpoint=True))
    """

    dp: int | None = None
    mp: int = 1
    shard: str | None = None
    checkpoint: bool = False
    pp: int = 1
    cp: int = 1
    precision: str | None = None
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "mp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if (value is not None or name != "dp") and (not isinstance(value, int) or isinstance(value, bool)
                                                        or value < 1):
                raise ValueError(f"Layout's {name} must be a positive int{' or None' if name == 'dp' else ''}, "
                                 f"got {value!r}")
        if self.shard not in SHARDS:
            raise ValueError(f"Layout's shard must be one of {SHARDS}, got {self.shard!r}")
        if not isinstance(self.checkpoint, bool):
            raise ValueError(f"Layout's checkpoint must be True or False, got {self.checkpoint!r}")
        object.__setattr__(self, "precision", _precision_name(self.precision))
        if self.dp is not None and self.dp % self.ep:
            raise ValueError(f"Layout's ep={self.ep} does not divide its dp={self.dp} data-parallel ranks (the experts "
                             f"are placed over ep of them): choose ep from "
                             f"{[k for k in range(1, self.dp + 1) if self.dp % k == 0]}")

    @property
    def ranks(self) -> int:
        """Ranks one data-parallel replica spans: ``mp x pp x cp``."""
        return self.mp * self.pp * self.cp

    def for_world(self, world_size: int) -> "Layout":
        """This layout with ``dp`` filled in for ``world_size`` ranks; raises where they do not make it."""
        if world_size % self.ranks or (self.dp is not None and self.dp * self.ranks != world_size):
            dp = "" if self.dp is None else f"dp={self.dp} x "
            raise ValueError(f"the layout {dp}cp={self.cp} x pp={self.pp} x mp={self.mp} does not make the world's "
                             f"{world_size} ranks: launch {'a multiple of ' if self.dp is None else ''}"
                             f"{(self.dp or 1) * self.ranks} ranks, or change the layout")
        return replace(self, dp=world_size // self.ranks)

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``parallelize`` that make this layout."""
        return {"mp": self.mp, "pp": self.pp, "cp": self.cp, "shard": self.shard, "checkpoint": self.checkpoint,
                "mixed_precision": self.precision, "ep": self.ep}

    @classmethod
    def of(cls, layout: "Layout | None", given: dict[str, Any]) -> "Layout":
        """The layout ``parallelize``'s keywords ``given`` make, over ``layout`` where one was passed: a keyword
        other than its default must agree with the layout's value."""
        if layout is not None and not isinstance(layout, Layout):
            raise TypeError(f"layout must be an autodist.Layout, got {type(layout).__name__}")
        if layout is None:
            options = {k: given.get(k, v) for k, v in DEFAULTS.items()}
            return cls(mp=options["mp"], pp=options["pp"], cp=options["cp"], shard=options["shard"],
                       checkpoint=options["checkpoint"], precision=options["mixed_precision"], ep=options["ep"])
        mine = layout.options()
        differ = {k: v for k, v in given.items() if k in DEFAULTS and v != DEFAULTS[k]
                  and _normal(k, v) != mine[k]}
        if differ:
            said = ", ".join(f"{k}={v!r}" for k, v in differ.items())
            raise ValueError(f"{said} given beside layout={layout.written()}, which says "
                             f"{', '.join(f'{k}={mine[k]!r}' for k in differ)}: give one or the other")
        return layout

    def written(self) -> str:
        """The layout as written by hand: its values other than the defaults."""
        default = Layout()
        given = [f"{k}={getattr(self, k)!r}" for k in ("dp", "mp", "pp", "cp", "shard", "checkpoint", "precision",
                                                        "ep")
                 if getattr(self, k) != getattr(default, k)]
        return f"Layout({', '.join(given)})"

    def __str__(self) -> str:
        parts = [] if self.dp is None else [f"dp={self.dp}"]
        parts += [f"{k}={getattr(self, k)}" for k in ("cp", "pp") if getattr(self, k) > 1]
        text = " x ".join([*parts, f"mp={self.mp}"]) + f", shard={self.shard!r}"
        if self.checkpoint:
            text += ", checkpoint=True"
        if self.ep > 1:
            text += f", ep={self.ep}"
        return text + (f", precision={self.precision!r}" if self.precision else "")


def _normal(key: str, value: Any) -> Any:
    return _precision_name(value) if key == "mixed_precision" else value
