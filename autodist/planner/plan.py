"""What a plan is: a :class:`~autodist.runtime.layout.Layout` (dp x mp, ``shard``, ``checkpoint``, the precision),
the search's settings (:class:`Auto`), one :class:`Row` per candidate and the :class:`ParallelPlan` that holds
them, prints as a table and saves as JSON.

Example:
    >>> plan = autodist.plan(model, loader)            # under autodist run -n 2
    >>> print(plan)                                     # one row per candidate, the chosen one marked
    >>> plan.save("plan.json")
    >>> model, loader = autodist.parallelize(model, loader, plan="plan.json")   # no search
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any

from autodist.runtime.held import KINDS
from autodist.runtime.layout import SHARDS, Layout

__all__ = ["SHARDS", "Auto", "Layout", "ParallelPlan", "Row", "rows_from", "size_text"]
FORMAT = 1  # the JSON's version


@dataclass(frozen=True)
class Auto:
    """The search's settings: ``plan=autodist.Auto(...)`` is ``plan="auto"`` with some of them set.

    Args:
        budget_gb: memory per rank, in GB (10**9 bytes); default: the GPU's free memory on CUDA, on CPU the
            host's available memory divided by this host's ranks, plus what the model already holds.
        optimizer_states: tensors the optimizer keeps per parameter: 2 for Adam and AdamW (the default), 1 for
            SGD with momentum, 0 for plain SGD. The trials step the matching torch optimizer.
        batch_size: rows of one global batch; default: the DataLoader's ``batch_size`` (required for other data).
        finalists: how many layouts are measured on a copy of the model, each the best modelled one of its
            family (dp x cp x pp x mp x shard level x ep): the best family of each mp, pp, cp and ep degree first,
            then the families the model ranks first (0: none, the model decides).
        steps: timed steps of each finalist, after two that make the optimizer's state and measure the peak;
            the median is its time.
        cp: search context parallelism too (``cp=K`` layouts, for a model whose forward makes attention calls;
            docs/context-parallel.md). Off unless asked, as it trains as one process only where the code around
            the model is per token: a loss that shifts or slices the logits or labels along the sequence outside
            the model (``logits[:, :-1]``) sees a rank's tokens, which cp cannot tell. ``cp=K`` given beside
            ``plan=`` searches it at that degree.

    Example:
        >>> model, loader = autodist.parallelize(model, loader, plan=autodist.Auto(budget_gb=6, optimizer_states=1))
    """

    budget_gb: float | None = None
    optimizer_states: int = 2
    batch_size: int | None = None
    finalists: int = 4
    steps: int = 8
    cp: bool = False

    def __post_init__(self) -> None:
        if self.budget_gb is not None and (isinstance(self.budget_gb, bool) or not isinstance(
                self.budget_gb, (int, float)) or not self.budget_gb > 0):
            raise ValueError(f"budget_gb must be a positive number of GB per rank or None, got {self.budget_gb!r}")
        for name, low in (("optimizer_states", 0), ("finalists", 0), ("steps", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(self.cp, bool):
            raise ValueError(f"cp must be True (search context parallelism too) or False, got {self.cp!r}: a degree "
                             f"is given as cp= beside plan= (parallelize(..., plan='auto', cp=2)), which keeps it")
        if self.batch_size is not None and (not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool)
                                            or self.batch_size < 1):
            raise ValueError(f"batch_size must be a positive int (rows of one global batch) or None, "
                             f"got {self.batch_size!r}")


@dataclass
class Row:
    """One candidate: its layout, predicted memory by kind (bytes per rank), its peak, whether it fits, its
    predicted and (for the finalists) measured step time, and what became of it."""

    layout: Layout
    memory: dict[str, float] = field(default_factory=dict)  # the kinds of autodist.memory, plus "activations"
    peak: float = 0.0  # predicted bytes per rank at the step's peak
    measured_peak: float | None = None
    seconds: float | None = None  # modelled time per step
    linked: float | None = None  # of the modelled time, the collectives' and sends' (the link's part)
    measured_seconds: float | None = None
    measured_memory: dict[str, float] = field(default_factory=dict)  # autodist.memory of the trial, at rest
    impossible: str = ""  # why this layout cannot be made ("" where it can)
    status: str = ""
    stages: list[int] | None = None  # with pp: the blocks of each stage, as predicted and tried (stages=)
    microbatches: int | None = None  # with pp: the micro-batches a step, as predicted and tried (microbatches=)

    @property
    def label(self) -> str:
        """The layout, with ``pp`` its micro-batches a step: rows differing only in them are layouts apart."""
        return str(self.layout) + (f", microbatches={self.microbatches}" if self.microbatches else "")

    @property
    def fits(self) -> bool:
        return not self.impossible and not self.status.startswith("does not fit")

    @property
    def time(self) -> float | None:
        """The step time the choice goes by: measured where it was, else modelled."""
        return self.measured_seconds if self.measured_seconds is not None else self.seconds


@dataclass
class ParallelPlan:
    """The chosen layout and every candidate behind the choice; ``print`` gives the table, ``line()`` the reason.

    Example:
        >>> plan = autodist.plan(model, loader)
        >>> plan.layout                        # Layout(dp=1, mp=2, shard=None, checkpoint=False)
        >>> plan.save("plan.json"); autodist.ParallelPlan.load("plan.json") == plan
        True
    """

    world_size: int
    budget: float  # bytes per rank
    optimizer_states: int
    batch_size: int
    layout: Layout
    rows: list[Row]
    reason: str = ""
    search_seconds: float = 0.0
    measured_on: int = 0  # a plan for another world (autodist.Target): the ranks it was measured on; 0: this one
    schedule: str = ""  # the pipelines' schedule planned: "1F1B" (loss_fn=, the loss inside the forward); "": GPipe

    def options(self) -> dict[str, Any]:
        """The keyword arguments of ``parallelize`` the plan chose (with ``pp``, the cut and the micro-batches it
        tried: ``stages=``, ``microbatches=``)."""
        chosen = next((r for r in self.rows if r.status == "chosen"), None)
        if chosen is None or chosen.layout != self.layout:
            return self.layout.options()
        staged = {"stages": chosen.stages, "microbatches": chosen.microbatches}
        return {**self.layout.options(), **{k: v for k, v in staged.items() if v}}

    def line(self) -> str:
        """The choice and why, in one line."""
        return f"plan: {self.layout} ({self.reason})"

    def __str__(self) -> str:
        kinds = [k for k in (*KINDS, "activations") if any(r.memory.get(k) for r in self.rows)]
        dims = ["dp", *(d for d in ("pp", "cp") if any(getattr(r.layout, d) > 1 for r in self.rows)), "mp",
                *(["ep"] if any(r.layout.ep > 1 for r in self.rows) else [])]
        head = (*dims, "shard", "ckpt", *(_short(k) for k in kinds), "peak", "fits", "time/step", "status")
        table = [head]
        for r in self.rows:  # with pp, its micro-batches a step: "2 x4"
            table.append((*(str(getattr(r.layout, d)) + (f" x{r.microbatches}" if d == "pp" and r.microbatches
                                                         else "") for d in dims), str(r.layout.shard),
                          "yes" if r.layout.checkpoint else "no", *(_mb(r.memory.get(k)) for k in kinds), _peak(r),
                          "-" if r.impossible else ("yes" if r.fits else "no"), _time(r), r.status))
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        lines.insert(1, "  ".join("-" * w for w in widths))
        where = f"{self.world_size} ranks" if not self.measured_on else \
            f"{self.world_size} ranks (predicted from {self.measured_on})"
        return "\n".join([f"{self.line()}; {where}, budget {size_text(self.budget)} per rank, "
                          f"global batch {self.batch_size}, {self.optimizer_states} optimizer states per parameter, "
                          f"{'computing in ' + self.layout.precision + ', ' if self.layout.precision else ''}"
                          f"searched in {self.search_seconds:.1f} s", *lines,
                          "memory in MB per rank (predicted; peak: predicted / measured); time: m = measured on a "
                          "copy of the model, ~ = modelled" + (f"; pp: stages x micro-batches a step, "
                                                              f"{self.schedule or 'GPipe'}" if "pp" in dims else "")])

    # -- JSON ----------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ParallelPlan":
        raw = json.loads(text)
        if raw.pop("format", None) != FORMAT:
            raise ValueError(f"not a plan autodist {FORMAT} can read (saved by ParallelPlan.save)")
        return cls(**{**raw, "layout": Layout(**raw["layout"]), "rows": rows_from(raw.pop("rows"))})

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "ParallelPlan":
        try:
            return cls.from_json(pathlib.Path(path).read_text())
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise ValueError(f"cannot read a plan from {str(path)!r}: {err}") from None


def rows_from(data: list[dict[str, Any]]) -> list[Row]:
    """Rows from plain data (``dataclasses.asdict`` of each, as JSON keeps them)."""
    return [Row(**{**r, "layout": Layout(**r["layout"])}) for r in data]


def size_text(nbytes: float) -> str:
    """Bytes in words: GB (10**9) with two decimals, MB below a tenth of a GB."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _short(kind: str) -> str:
    return {"model buffers": "buffers", "optimizer state": "optimizer", "autodist buffers": "autodist",
            "shared memory": "shared"}.get(kind, kind)


def _mb(value: float | None) -> str:
    return "-" if not value else f"{value / 1e6:.1f}"


def _peak(r: Row) -> str:
    if not r.peak:
        return "-"
    return f"{r.peak / 1e6:.1f}" + ("" if r.measured_peak is None else f" / {r.measured_peak / 1e6:.1f}")


def _time(r: Row) -> str:
    modelled = "-" if r.seconds is None else f"{1e3 * r.seconds:.1f} ms ~"
    return modelled if r.measured_seconds is None else f"{1e3 * r.measured_seconds:.1f} ms m ({modelled})"
