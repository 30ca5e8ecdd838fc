"""Checkpoints that resume at any world size or model-parallel degree, written atomically.

A checkpoint holds the *dense* single-process training state: what one process
training the original model would have, whatever layout saved it. So a run
saved on 2 ranks with ``mp=2`` resumes in one process, on 2 ranks with
``mp=1``, or back at ``mp=2``.

File format: one ``torch.save`` file that loads with
``torch.load(path, weights_only=True)`` (tensors, numbers, strings, lists and
dicts only); its top-level keys are

==============  ==========================================================================
``format``      ``"autodist.checkpoint"``; ``version``: the format version (1)
``model``       the dense state dict with the original model's names (``gather_state_dict``):
                ``plain_model.load_state_dict(torch.load(path, weights_only=True)["model"])``
``optimizer``   None, or ``{"state": {parameter name: {key: value}}, "param_groups":
                [{hyperparameters..., "params": [parameter names]}]}``: every per-parameter
                state tensor of the parameter's shape is dense (shards gathered); scalars
                such as Adam's ``step`` are kept as they are
``extra``       the keyword arguments given to ``save`` (epoch, step, a loader's generator state)
``rng``         rank 0's random generators: ``torch`` (CPU), ``cuda`` (the current device's,
                or None), ``python`` and ``numpy``
``loaders``     only where ``parallelize`` split a DataLoader (or a stream) for the model: rank 0's
                position in each, in the order they were made: ``{"epoch": int, "taken": int,
                "rng": tensor or None, "generators": [tensor, ...]}``. In an epoch: its number,
                the global batches the loop has taken, torch's global generator and the
                loader's and its sampler's own as it began. Between epochs: the next one's
                number, ``taken`` 0, ``rng`` None, and those generators as they are. ``load``
                gives each loader its position (:mod:`autodist.dp.loader_position`)
``sync``        only for a model trained with a low-communication mode (``parallelize(...,
                sync=autodist.DiLoCo())``): ``{"mode": "DiLoCo", "state": ...}``, rank 0's
                ``strategy.state_dict()`` (step counts; DiLoCo's outer parameters, their momentum
                and the average under way). Its entries named in ``strategy.mirrors`` map the
                model's tensor names to per-tensor state: dense (shards gathered) and keyed by the
                original model's names, as ``model`` is; ``load`` cuts them to the loading
                layout and gives the state back to the model's strategy
``checksum``    ``{"algorithm": "crc32", "structure": int, "tensors": [int, ...]}``: a CRC-32 of
                every tensor's bytes (in the order the entries above are walked) and one of
                everything else (names, dtypes, shapes, numbers, strings); ``load`` recomputes
                them and refuses a file that differs. Files written before checksums existed
                have no such key: they load, with a warning that nothing was verified.
==============  ==========================================================================

Rank 0 writes the file (:mod:`autodist.train.checkpoint_file`): to a temporary file beside it, flushed and fsynced,
then ``os.replace``d over the final name and the directory fsynced, so the
final name only ever holds a complete checkpoint. A writer killed mid-write
(SIGKILL, power loss) leaves its temporary behind; the temporary's name says
which process on which machine wrote it, and the next ``save`` of the same
checkpoint removes those whose writer is gone. Loading needs no
communication: every rank reads the file and keeps its slice of each split
layer. ``resume`` is ``load`` when the checkpoint exists and the given
defaults when it does not, so one script both starts and restarts a run.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp import loader_position
from autodist.ep import place as ep_place
from autodist.ep import saved as ep_saved
from autodist.faults import elastic
from autodist.layers.shard import Shard
from autodist.mp.gather import gather_state_dict
from autodist.mp.rewrite import mp_modules
from autodist.pp.pipeline import pipeline_of
from autodist.runtime.compiled import PREFIX, unwrapped
from autodist.runtime.world import World, init, log
from autodist.sync import strategy_of
from autodist.train.checkpoint_file import (FORMAT, VERSION, CheckpointError, atomic_save, check_loadable, checked_path,
                                            contents, leaves, read, rng_state, set_rng_state)

__all__ = ["save", "load", "resume", "CheckpointError", "FORMAT", "VERSION"]

PathLike = Union[str, "os.PathLike[str]"]



# -- arguments -----------------------------------------------------------------------------------


def _check_model(model: Any) -> nn.Module:
    """The model to work on (the one inside ``torch.compile``'s wrapper), or a TypeError naming what came."""
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise TypeError(f"Expect an nn.Module instance for model, the class {model.__name__} found; pass the "
                        f"model you train, e.g. {model.__name__}(...) as built in your script")
    if not isinstance(model, nn.Module):
        raise TypeError(f"Expect nn.Module for model, {type(model).__name__} found")
    return unwrapped(model)


def _brief(value: Any, width: int = 40) -> str:
    """``repr(value)`` for a log line: whole where short, else what it is (a scheduler's dict: its keys)."""
    shown = repr(value)
    if len(shown) <= width:
        return shown
    if isinstance(value, dict):
        keys = ", ".join(map(str, list(value)[:4])) + (", ..." if len(value) > 4 else "")
        return f"<dict of {len(value)}: {keys}>"
    if isinstance(value, (list, tuple)):
        return f"<{type(value).__name__} of {len(value)}>"
    return shown[:width - 3] + "..."


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    if isinstance(optimizer, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError(f"Expect torch.optim.Optimizer or None for optimizer, the LR scheduler "
                        f"{type(optimizer).__name__} found; pass its optimizer, and the scheduler's state as an "
                        f"extra: save(path, model, optimizer, scheduler=scheduler.state_dict())")
    raise TypeError(f"Expect torch.optim.Optimizer or None for optimizer, {type(optimizer).__name__} "
                    f"{optimizer!r:.40} found; pass the optimizer object itself, built after parallelize, e.g. "
                    f"torch.optim.SGD(model.parameters(), lr=0.1)")


@dataclass(frozen=True)
class _Slot:
    """Where one local state-dict entry lives in the dense model: its name and, if split, how."""

    name: str  # the dense (original model's) name
    shape: tuple[int, ...] | None  # the dense shape (None: not a tensor)
    part: Shard | None = None  # how the dense tensor is split (None: held whole)

    def shard(self, dense: torch.Tensor) -> torch.Tensor:
        return dense if self.part is None else self.part.take(dense)


def _layout(model: nn.Module) -> dict[str, _Slot]:
    """Every key of ``model.state_dict()`` -> its slot in the dense model."""
    pipeline = pipeline_of(model)
    with pipeline.shapes_only() if pipeline is not None else nullcontext(), ep_place.local_state(model):
        local = model.state_dict()  # the shapes: no gathering
    slots = {key: _Slot(key, tuple(value.shape) if isinstance(value, torch.Tensor) else None)
             for key, value in local.items()}
    for name, layer in mp_modules(model):
        prefix = f"{name}." if name else ""
        original = getattr(layer, "dense_names", {})  # the layer replaced an F.linear call
        for key, part in layer.shards.items():
            if getattr(layer, key, None) is not None:
                slots[prefix + key] = _Slot(original.get(key, prefix + key), part.shape,
                                            part if part.dim is not None else None)
    placement = ep_place.placement_of(model)
    for placed in [] if placement is None else placement.modules:  # each rank its slice of the experts
        if isinstance(placed, ep_place.PlacedModules):
            continue  # whole experts of this rank's, under their names: the local state dict's slots as they are
        for key, part in placed.shards.items():
            name = f"{placed.name}.{key}" if placed.name else key
            slots[name] = _Slot(name, part.shape, part)
    return slots


def _refuse_module_experts(model: nn.Module, what: str) -> None:
    if ep_saved.has_modules(model):
        raise NotImplementedError(f"{what} numbers parameters by their place in the optimizer, and with experts held "
                                  f"as modules placed with ep each rank's optimizer holds its own experts: use "
                                  f"autodist.save and autodist.load, which name them")


def _param_slots(model: nn.Module, optimizer: torch.optim.Optimizer,
                 layout: dict[str, _Slot]) -> list[tuple[nn.Parameter, _Slot]]:
    """The optimizer's parameters, in its order, each with its slot; raises on one the model lacks."""
    by_id = {id(p): layout[key] for key, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [tuple(p.shape) for p in params if id(p) not in by_id]
    if strangers:
        raise ValueError(f"{type(optimizer).__name__} holds {len(strangers)} parameter(s) of shapes {strangers} "
                         f"that are not parameters of the model ({type(model).__name__}); build the optimizer "
                         f"over model.parameters() after autodist.parallelize (model parallelism replaces the "
                         f"split layers' parameters)")
    return [(p, by_id[id(p)]) for p in params]


# -- what is saved -------------------------------------------------------------------------------


def _dense_value(value: Any, param: nn.Parameter, slot: _Slot) -> Any:
    """A per-parameter optimizer state entry, gathered to the dense parameter's shape when it is a shard."""
    if not isinstance(value, torch.Tensor):
        return value
    if slot.part is not None and value.shape == param.shape:
        return slot.part.gather(value).cpu()
    return value.detach().to("cpu", copy=True)


def _dense_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module,
                           layout: dict[str, _Slot]) -> dict[str, Any]:
    """The optimizer's state keyed by dense parameter names, shards gathered (collective over MP groups)."""
    params = _param_slots(model, optimizer, layout)
    packed = optimizer.state_dict()  # per-parameter state keyed by position in the param groups
    state = {params[index][1].name: entries for index, entries in _dense_entries(packed["state"], params).items()}
    groups = [{**{k: v for k, v in group.items() if k not in ("params", "param_names")},
               "params": [params[i][1].name for i in group["params"]]} for group in packed["param_groups"]]
    check_loadable(groups, "the optimizer's param_groups")
    return {"state": state, "param_groups": groups}


def _dense_entries(packed: dict[int, dict[str, Any]], params: list[tuple[nn.Parameter, _Slot]]
                   ) -> dict[int, dict[str, Any]]:
    """An optimizer's per-parameter state (by position) with every shard gathered to its dense shape. In one
    order, of positions and of keys: every rank of a group gathers the same tensor together."""
    return {index: {k: _dense_value(v, *params[index]) for k, v in sorted(entries.items(), key=str)}
            for index, entries in sorted(packed.items())}


def _writer(world: World) -> bool:
    """Whether this rank writes the checkpoint: rank 0, or in an elastic job the first of the ranks left."""
    state = elastic.current()
    return world.rank == 0 if state is None else state.rank == 0


def _write_on_rank0(payload: dict[str, Any] | None, path: str, world: World) -> None:
    """Rank 0 (:func:`_writer`) writes; then every rank waits for it, and raises too if it failed."""
    error: BaseException | None = None
    state = elastic.current()
    if _writer(world):
        try:
            atomic_save(payload, path)  # type: ignore[arg-type]
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = err
    failed = error is not None
    if world.size > 1:  # an all-reduce is the barrier, and tells the others whether rank 0 succeeded
        device = world.device if world.backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([float(failed)], device=device)
        dist.all_reduce(flag, group=None if state is None else state.group)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"rank 0 could not write the checkpoint {path!r} (its traceback says why); the file "
                           f"there, if any, is the previous checkpoint, unchanged")


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for _, leaf in leaves(value, ""))


def _dense_mirror(entries: dict[str, Any], layout: dict[str, _Slot], where: str) -> dict[str, torch.Tensor]:
    """A strategy's per-tensor state keyed by dense names, shards gathered (collective over MP groups)."""
    dense = {}
    for name in sorted(entries):  # one order on every rank of a group: they gather the same tensor together
        value, slot = entries[name], layout.get(name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{where}[{name!r}] is a {type(value).__name__}; an entry the strategy names in "
                            f"mirrors maps the model's tensor names to tensors")
        if slot is None or slot.part is None:  # held whole (or a non-persistent buffer: no slot)
            dense[name if slot is None else slot.name] = value.detach().to("cpu", copy=True)
        elif tuple(value.shape) != slot.part.local_shape():
            raise ValueError(f"{where}[{name!r}] has shape {tuple(value.shape)}; the model's {name!r} here has "
                             f"{slot.part.local_shape()}: per-tensor state must have its tensor's shape")
        else:
            dense[slot.name] = slot.part.gather(value).cpu()
    return dense


def _local_mirror(entries: dict[str, torch.Tensor], layout: dict[str, _Slot]) -> dict[str, torch.Tensor]:
    """Saved per-tensor state cut to this model's layout and keyed by its names; a name this model lacks
    stays as it is (the strategy refuses what does not fit)."""
    local = {key: slot.shard(entries[slot.name]) for key, slot in layout.items()
             if slot.name in entries and tuple(entries[slot.name].shape) == slot.shape}
    dense_names = {slot.name for key, slot in layout.items() if key in local}
    return {**local, **{name: value for name, value in entries.items() if name not in dense_names}}


def _sync_state(model: nn.Module, layout: dict[str, _Slot]) -> dict[str, Any] | None:
    """The state of the model's low-communication strategy, if it has any, its per-tensor entries dense (every
    rank: it may wait for an exchange under way, and gathers shards)."""
    strategy = strategy_of(model)
    state = strategy.state_dict() if strategy is not None else None
    if not state:
        return None
    unnamed = [key for key, value in state.items() if key not in strategy.mirrors and _holds_tensor(value)]
    if unnamed and mp_modules(model):
        log.warning("the checkpoint does not hold the state of %r with mp > 1: its entries %s hold tensors it "
                    "does not name in %s.mirrors, so they may be this rank's shards, which a dense checkpoint "
                    "cannot hold as they are; a restart starts its next round from the loaded model",
                    strategy, unnamed, type(strategy).__name__)
        return None
    where = f"the state of {strategy!r}"
    state = {key: _dense_mirror(value, layout, f"{where}[{key!r}]") if key in strategy.mirrors else value
             for key, value in state.items()}
    check_loadable(state, where)
    return {"mode": type(strategy).__name__, "state": state}


def _restore_sync(model: nn.Module, saved: dict[str, Any] | None, path: str, layout: dict[str, _Slot]) -> None:
    """Give the model's strategy its saved state, cut to this layout, or tell it to start afresh from the
    loaded model."""
    strategy = strategy_of(model)
    if strategy is None:
        return
    if saved is not None and saved["mode"] != type(strategy).__name__:
        log.info("the checkpoint %s holds the state of a %s run; this run uses %r, which starts afresh from the "
                 "loaded model", path, saved["mode"], strategy)
        saved = None
    state = None if saved is None else {key: _local_mirror(value, layout) if key in strategy.mirrors else value
                                        for key, value in saved["state"].items()}
    strategy.load_state_dict(state)


def save(path: PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **extra: Any) -> None:
    """Save a checkpoint that resumes at any world size or model-parallel degree.

    Every rank must call it (model-parallel shards are gathered with
    collectives); rank 0 writes the file atomically and every rank returns
    only once it is complete, so any rank may load it right after.

    Args:
        path: the file to write; missing parent directories are created, an
            existing file is replaced only once the new one is complete, and
            temporaries of earlier saves of it that were killed mid-write
            are removed.
        model: the model (parallelized or not).
        optimizer: its optimizer, built over ``model.parameters()`` after
            ``parallelize``; None to save the model alone.
        **extra: anything else to resume with (epoch, step, a scheduler's
            ``state_dict()``): numbers, strings, tensors, None, and
            lists/tuples/dicts of them. ``load`` returns them.

    Returns:
        None. The file holds a CRC-32 of every tensor and of the rest, which
        ``load`` checks.

    Example:
        >>> autodist.save("ckpt/last.pt", model, optimizer, epoch=epoch, step=step)

    Note:
        The random generators saved are rank 0's (torch CPU, the current CUDA
        device's, python ``random``, numpy); ``load`` restores them on every
        rank. A run whose ranks draw different random numbers (dropout seeded
        per rank) should reseed per rank after loading. Where each loader
        ``parallelize`` split for the model stands is saved too (the epoch,
        the global batches taken, the generators as it began), so that the
        loop resumes mid-epoch (:mod:`autodist.dp.loader_position`). A model in a
        low-communication mode (``sync=autodist.DiLoCo()``, ...) has its mode's
        state saved too (DiLoCo's outer parameters and momentum, step counts),
        which ``load`` gives back to it.
    """
    path = checked_path(path, writing=True)
    model = _check_model(model)
    _check_optimizer(optimizer)
    check_loadable(extra, "extra")
    world = init()
    rng = rng_state()  # before anything below could draw
    layout = _layout(model)
    sync = _sync_state(model, layout)
    optim = None if optimizer is None else _dense_optimizer_state(optimizer, model, layout)
    state = gather_state_dict(model, all_ranks=elastic.current() is not None)  # the writer may not be rank 0
    if optim is not None and ep_saved.has_modules(model):  # each rank its own experts: their state merged (over
        # the expert group: with pp, each stage's, before the stages' states go to the first)
        optim = ep_saved.merged_optimizer_state(model, optim, None if state is None else list(state))
    pipeline = pipeline_of(model)
    if optim is not None and pipeline is not None:  # each stage holds its blocks' state
        optim = pipeline.dense_optimizer_state(optim)
    payload = None
    if _writer(world):
        payload = contents(state, optim, extra, rng, sync, loader_position.positions(model))
    _write_on_rank0(payload, path, world)


# -- loading -------------------------------------------------------------------------------------

def _listed(names: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{f', ... ({len(names) - limit} more)' if len(names) > limit else ''}]"


def _check_model_keys(dense: dict[str, Any], layout: dict[str, _Slot], model: nn.Module, where: str,
                      source: str, strict: bool) -> None:
    """Raise where ``dense`` (``where``: "the checkpoint 'path'", say; a ``source``) does not fit ``model``: keys
    missing or unexpected (if ``strict``), or a dense shape that differs."""
    expected = {slot.name for slot in layout.values()} | ep_saved.held_elsewhere(model)  # theirs to load
    missing, unexpected = sorted(expected - dense.keys()), sorted(dense.keys() - expected)
    if strict and (missing or unexpected):
        raise RuntimeError(f"{where} does not fit the model ({type(model).__name__}): missing keys (in the model, "
                           f"not in the {source}) {_listed(missing)}; unexpected keys (in the {source}, not in the "
                           f"model) {_listed(unexpected)}. Load it into the model it was saved from, built as in the "
                           f"single-process script")
    wrong = [f"{s.name!r}: {source} {tuple(dense[s.name].shape)}, model {s.shape}" for s in layout.values()
             if s.shape is not None and isinstance(dense.get(s.name), torch.Tensor)
             and tuple(dense[s.name].shape) != s.shape]
    if wrong:
        raise RuntimeError(f"{where} does not fit the model ({type(model).__name__}): size mismatch (dense shapes) "
                           f"for {_listed(wrong)}; build the model with the sizes it was saved with")


def _named_as_the_model(dense: dict[str, Any], layout: dict[str, _Slot]) -> dict[str, Any]:
    """``dense`` without the ``_orig_mod.`` before every name where ``torch.compile``'s wrapper was saved (a file
    written before autodist unwrapped it, or a state dict of the wrapper) and the model's names have none."""
    names = {slot.name for slot in layout.values()}
    if dense and all(k.startswith(PREFIX) for k in dense) and not any(n.startswith(PREFIX) for n in names):
        return {k.removeprefix(PREFIX): v for k, v in dense.items()}
    return dense


def _load_model(dense: dict[str, Any], model: nn.Module, layout: dict[str, _Slot], where: str,
                source: str = "checkpoint", strict: bool = True) -> Any:
    """Check ``dense`` against the model, then load each rank's slice of it; ``model.load_state_dict``'s result."""
    dense = _named_as_the_model(dense, layout)
    _check_model_keys(dense, layout, model, where, source, strict)
    local = {key: slot.shard(dense[slot.name]) if slot.shape is not None else dense[slot.name]
             for key, slot in layout.items() if slot.name in dense}
    return model.load_state_dict(local, strict=strict)


def _local_entries(entries: dict[str, Any], slot: _Slot) -> dict[str, Any]:
    """A parameter's saved optimizer state with every dense, parameter-shaped tensor cut to this rank's shard."""
    def local(value: Any) -> Any:
        dense = isinstance(value, torch.Tensor) and tuple(value.shape) == slot.shape
        return slot.shard(value) if dense else value
    return {key: local(value) for key, value in entries.items()}


def _check_group_names(i: int, names: list[str], saved: list[str]) -> None:
    if sorted(names) != sorted(saved):
        raise ValueError(f"optimizer parameter group {i} holds {_listed(sorted(names))}, but the checkpoint's "
                         f"group {i} holds {_listed(sorted(saved))}; build the optimizer over the same "
                         f"parameters, grouped as when it was saved")


def _local_optimizer_state(saved: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module,
                           layout: dict[str, _Slot]) -> dict[str, Any]:
    """The saved optimizer state in torch's index-based format for ``optimizer``, state tensors sliced."""
    params = _param_slots(model, optimizer, layout)
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter group(s), "
                         f"{type(optimizer).__name__} has {len(optimizer.param_groups)}; build the optimizer "
                         f"with the same groups as when it was saved")
    state, groups, start = {}, [], 0
    held = ({layout[key].name for key, _ in model.named_parameters()}
            if pipeline_of(model) is not None or ep_saved.has_modules(model) else None)  # a stage's, a rank's experts
    for i, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        indices = range(start, start + len(group["params"]))  # torch numbers parameters across the groups
        names = saved_group["params"] if held is None else [n for n in saved_group["params"] if n in held]
        _check_group_names(i, [params[j][1].name for j in indices], names)
        for j in indices:
            entries = saved["state"].get(params[j][1].name)
            if entries is not None:
                state[j] = _local_entries(entries, params[j][1])
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": list(indices)})
        start += len(indices)
    return {"state": state, "param_groups": groups}


def load(path: PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` into a model laid out in any way, and its optimizer.

    Each rank reads the file and keeps its slice of every split layer and of
    the optimizer state belonging to it: a checkpoint saved at one world size
    or ``mp`` resumes at another, or in a plain single-process script. No
    communication: it works without a process group.

    Args:
        path: a file written by ``autodist.save``.
        model: the model to fill, parallelized (as it will be trained) or plain.
        optimizer: its optimizer, built over ``model.parameters()`` after
            ``parallelize``, with the same parameter groups as the saved one
            (hyperparameters such as ``lr`` come from the checkpoint).

    Returns:
        The ``extra`` keyword arguments given to ``save`` (e.g. ``{"epoch": 3}``).

    Raises:
        CheckpointError: (a ValueError) the file is damaged (a checksum
            differs), truncated, or not an autodist checkpoint; the message
            names the file. Resume from an earlier one, or delete it.

    Example:
        >>> model, loader = autodist.parallelize(build_model(), loader, mp=2)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> start = autodist.load("ckpt/last.pt", model, optimizer)["epoch"]

    Note:
        Restores rank 0's random generators (as saved) on every rank. Call it
        after building an LR scheduler: building one resets the learning rates.
    """
    path = checked_path(path, writing=False)
    model = _check_model(model)
    _check_optimizer(optimizer)
    checkpoint = read(path)
    layout = _layout(model)
    _load_model(checkpoint["model"], model, layout, f"the checkpoint {path!r}")
    if optimizer is not None:
        if checkpoint["optimizer"] is None:
            raise ValueError(f"the checkpoint {path!r} was saved without an optimizer; pass optimizer=None, or "
                             f"save with autodist.save(path, model, optimizer)")
        optimizer.load_state_dict(_local_optimizer_state(checkpoint["optimizer"], optimizer, model, layout))
    _restore_sync(model, checkpoint.get("sync"), path, layout)
    set_rng_state(checkpoint["rng"])
    loader_position.restore(model, checkpoint.get("loaders", []), f"the checkpoint {path!r}")
    return dict(checkpoint["extra"])


def _found_on_every_rank(path: str, world: World) -> bool:
    """Whether ``path`` is a file, as every rank sees it; raises if the ranks disagree."""
    found = os.path.isfile(path)
    if world.size == 1:
        return found
    device = world.device if world.backend == "nccl" else torch.device("cpu")
    seen = torch.zeros(world.size, device=device)
    seen[world.rank] = float(found)
    dist.all_reduce(seen)
    missing = [r for r, s in enumerate(seen.tolist()) if not s]
    if 0 < len(missing) < world.size:
        raise RuntimeError(f"ranks {missing} see no checkpoint at {path!r} where the other ranks see one; every "
                           f"rank must read the same checkpoint: put it on a file system every node shares")
    return found


def resume(path: PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
           **defaults: Any) -> dict[str, Any]:
    """Restart from the checkpoint at ``path`` if there is one; start afresh if not.

    One script then both starts a run and restarts it after a failure (under
    ``autodist run --max-restarts N``, or when a job is requeued): the first
    attempt finds no checkpoint and gets ``defaults``; a later one loads
    model, optimizer and random generators as ``load`` does and gets the
    extras saved with them. Every rank must call it: they check together
    that all of them see the same file.

    Args:
        path: the checkpoint file the script writes with ``autodist.save``.
        model: the model to fill, parallelized (as it will be trained) or plain.
        optimizer: its optimizer, built over ``model.parameters()`` after
            ``parallelize``, or None.
        **defaults: what to return when there is no checkpoint yet (e.g.
            ``epoch=0``); a saved extra of the same name replaces its default.

    Returns:
        ``defaults`` updated with the extras saved in the checkpoint.

    Raises:
        CheckpointError: the checkpoint exists but is damaged or truncated
            (never silently ignored: that would restart the run from scratch).

    Example:
        >>> model, loader = autodist.parallelize(build_model(), loader)
        >>> optimizer = torch.optim.Adam(model.parameters())
        >>> start = autodist.resume("ckpt/last.pt", model, optimizer, epoch=0)["epoch"]
        >>> for epoch in range(start, epochs):
        ...     train_one_epoch(model, loader, optimizer)
        ...     autodist.save("ckpt/last.pt", model, optimizer, epoch=epoch + 1)

    Note:
        A restart repeats the steps since the last save; save as often as
        you accept to repeat. A loader ``parallelize`` split goes on where
        the checkpoint left it, mid-epoch too: the next batch it gives is
        the one after the last taken before the save, at any number of
        ranks, plain ``python`` (a world of one) included.
    """
    path = checked_path(path, writing=False)
    model = _check_model(model)
    _check_optimizer(optimizer)
    world = init()
    state = elastic.current()
    if state is not None and state.joined_epoch is not None:  # the members' live state, not the file: loaded
        return _joined(defaults, state.joined_epoch)
    if not _found_on_every_rank(path, world):
        if world.rank == 0:
            log.info("no checkpoint at %s yet: starting from the beginning", path)
        return dict(defaults)
    extra = load(path, model, optimizer)
    if world.rank == 0:
        log.info("resumed from %s (%s)", path, ", ".join(f"{k}={_brief(v)}" for k, v in extra.items()) or "no extras")
    return {**defaults, **extra}


def _joined(defaults: dict[str, Any], epoch: int) -> dict[str, Any]:
    """What ``resume`` returns on a rank that joined a running elastic job: the members' epoch in progress as
    ``epoch``; other extras as their defaults, said once (their live values are the script's own)."""
    others = sorted(k for k in defaults if k != "epoch")
    if others:
        log.warning("autodist.resume on a rank that joined a running elastic job: the model, optimizer and loader "
                    "come from the other ranks, epoch=%d is theirs, and %s come back as the defaults given (their "
                    "live values are the script's own)", epoch, ", ".join(others))
    return {**defaults, **({"epoch": epoch} if "epoch" in defaults else {})}


# -- dense state for other checkpoint formats (a framework's own saving and loading) --------------


def load_dense_state_dict(model: nn.Module, state: dict[str, Any], *, strict: bool = True,
                          where: str = "the state dict") -> Any:
    """Load a dense, single-process state dict (``gather_state_dict``'s, or a plain model's ``state_dict()``)
    into ``model`` laid out in any way: each rank keeps its slice of every split layer. No communication.

    Args:
        model: the model to fill, parallelized or plain.
        state: the dense state dict, with the original model's names.
        strict: as for ``load_state_dict``: every key of the model must be in ``state`` and no other.
        where: what ``state`` is, for the error (e.g. the checkpoint's path).

    Returns:
        What ``model.load_state_dict`` returns (the missing and unexpected keys).

    Example:
        >>> load_dense_state_dict(model, torch.load("model.pt", weights_only=True))
    """
    model = _check_model(model)
    return _load_model(state, model, _layout(model), where, "state", strict)


def dense_optimizer_state_dict(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """``optimizer.state_dict()`` in torch's own format (state by parameter index), every per-parameter tensor
    dense: what one process training the original model holds, so ``optimizer.load_state_dict`` takes it there.

    Every rank must call it (model-parallel shards are gathered, and a sharded optimizer's slices).

    Args:
        optimizer: built over ``model.parameters()`` after ``parallelize``.
        model: its model, parallelized or plain.

    Returns:
        ``{"state": {index: {key: value}}, "param_groups": [...]}``, tensors on the CPU.

    Example:
        >>> torch.save(dense_optimizer_state_dict(optimizer, model), "optimizer.pt")   # loads in one process
    """
    model = _check_model(model)
    _check_optimizer(optimizer)
    _refuse_module_experts(model, "autodist.dense_optimizer_state_dict")
    params = _param_slots(model, optimizer, _layout(model))
    packed = optimizer.state_dict()  # a sharded optimizer's post hook has made it dense over the data-parallel ranks
    return {"state": _dense_entries(packed["state"], params), "param_groups": packed["param_groups"]}


def load_dense_optimizer_state_dict(optimizer: torch.optim.Optimizer, model: nn.Module,
                                    state: dict[str, Any]) -> None:
    """Load a dense optimizer state in torch's format (:func:`dense_optimizer_state_dict`'s, or a plain
    optimizer's ``state_dict()``) into ``optimizer``, each parameter's state cut to this rank's slice of it.

    The state's parameter indices are the optimizer's order, which is the plain model's: build the optimizer
    over ``model.parameters()`` (after ``parallelize``), with the groups it was saved with. No communication.

    Example:
        >>> load_dense_optimizer_state_dict(optimizer, model, torch.load("optimizer.pt", weights_only=True))
    """
    model = _check_model(model)
    _check_optimizer(optimizer)
    _refuse_module_experts(model, "autodist.load_dense_optimizer_state_dict")
    params = _param_slots(model, optimizer, _layout(model))
    sizes = [len(group["params"]) for group in state["param_groups"]]
    if sizes != [len(group["params"]) for group in optimizer.param_groups]:
        raise ValueError(f"the saved optimizer state has parameter groups of {sizes} parameters, "
                         f"{type(optimizer).__name__} has {[len(g['params']) for g in optimizer.param_groups]}; build "
                         f"the optimizer with the same groups as when it was saved")
    local = {}
    for index, entries in state["state"].items():
        slot = params[int(index)][1]
        wrong = [k for k, v in entries.items() if isinstance(v, torch.Tensor) and slot.shape is not None
                 and v.ndim == len(slot.shape) and v.ndim > 0 and tuple(v.shape) != slot.shape]
        if wrong:
            raise ValueError(f"the saved optimizer state of parameter {index} ({slot.name!r}) has {wrong[0]!r} of "
                             f"shape {tuple(entries[wrong[0]].shape)}, but that parameter's dense shape is "
                             f"{slot.shape}: the state was saved for another model, or its optimizer held the "
                             f"parameters in another order")
        local[int(index)] = _local_entries(entries, slot)
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})
