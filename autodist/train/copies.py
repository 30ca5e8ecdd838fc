"""``copy.deepcopy`` and pickling of a parallelized model: an ordinary module with the whole weights.

``parallelize`` gives the model two instance attributes, ``__deepcopy__`` and ``__reduce_ex__`` (Python
looks them up on the instance first; the model's class and ``type(model)`` stay the user's), so that:

* ``copy.deepcopy(model)`` (``AveragedModel``, timm's and diffusers' EMA) is the model as one process would
  hold it: none of autodist's hooks, process groups or shared memory, the whole current weights (this rank's
  replica under a low-communication mode). Where they are not whole on this rank it gathers them, a
  collective every rank enters: ``shard="parameters"`` gathers its blocks (on a group of their own) and
  ``mp=K`` gathers the split layers into the model as it was passed to ``parallelize`` (the dense layers
  back). A rank that copies alone waits, named, in a step every rank must take, until the watchdog stops
  the job: it never meets another rank's forward.
* pickling (``torch.save(model, f)``, ``pickle.dumps``) never communicates, as DDP's: it writes that same
  ordinary module where this rank holds the whole weights (every level but ``"parameters"``, and inside
  ``autodist.full_parameters(model)``), and elsewhere raises, naming ``autodist.save`` and
  ``gather_state_dict``.

Example:
    >>> model, loader = autodist.parallelize(model, loader)
    >>> ema = torch.optim.swa_utils.AveragedModel(model)   # an ordinary module, on every rank
    >>> torch.save(model, "model.pt")                       # loads as the plain module
"""
from __future__ import annotations

import copy
import copyreg
import functools
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from autodist.dp import batch_norm
from autodist.ep import place as ep_place
from autodist.mp.gather import gather_state_dict
from autodist.runtime.position import waiting
from autodist.sharded import parameters as sharded_parameters
from autodist.sharded.recompute import is_recomputing
from autodist.train import habits

_HOOKS = ("_backward_pre_hooks", "_backward_hooks", "_forward_hooks", "_forward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_BY_ID = ("_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs")
_ENTRIES = ("__deepcopy__", "__reduce_ex__")


def skeleton(model: nn.Module) -> nn.Module | str:
    """The model's structure with its tensors on the meta device (no memory), taken before ``mp`` splits it:
    what a copy of the split model fills with the gathered weights. A message if the model cannot be copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:  # noqa: BLE001 - said when a copy is asked for
        return f"{type(model).__name__} could not be copied when parallelize split it ({type(err).__name__}: {err})"


def make_copyable(model: nn.Module, split: nn.Module | str | None, everyone: Any) -> None:
    """Give ``model`` its ``__deepcopy__`` and ``__reduce_ex__`` (see the module docstring). ``split``: the
    :func:`skeleton` of a model ``mp`` splits, None otherwise; ``everyone``: a process group over the world of
    its own, where the ranks meet before gathering a split model's layers."""
    ref = weakref.ref(model)
    model.__dict__["__deepcopy__"] = _Entry(ref, split, everyone, "copy")
    model.__dict__["__reduce_ex__"] = _Entry(ref, split, everyone, "pickle")


class _Entry:
    """One of the two instance attributes; holds the model weakly (no cycle keeps it alive)."""

    def __init__(self, ref: weakref.ref, split: nn.Module | str | None, everyone: Any, kind: str) -> None:
        self.ref, self.split, self.everyone, self.kind = ref, split, everyone, kind

    def __call__(self, arg: Any) -> Any:
        model = self.ref()
        assert model is not None
        if self.kind == "copy":
            return plain(model, arg, self.split, self.everyone, clone=True)
        _check_picklable(model, self.split)
        reduced = plain(model, {}, None, None, clone=False).__reduce_ex__(arg)
        if reduced[0] is copyreg.__newobj__ and len(reduced[1]) == 1:
            # the same object rebuilt, through a function pickle does not check against type(model) (the
            # subclass habits.adopt gave it): the pickle holds only the user's class and torch's
            reduced = (copyreg._reconstructor, (reduced[1][0], object, None), *reduced[2:])
        return reduced

    def __deepcopy__(self, memo: dict) -> None:  # never copied along: the copy is an ordinary module
        return None


def _check_picklable(model: nn.Module, split: nn.Module | str | None) -> None:
    sharding = sharded_parameters.sharding_of(model)
    if split is not None:
        raise RuntimeError(
            "pickling a model split by parallelize(..., mp=K) (torch.save(model) or pickle.dumps): each rank holds "
            "only its part of the split layers, and pickling does not communicate. Save with autodist.save(path, "
            "model, optimizer) (every rank calls it), or take state = autodist.gather_state_dict(model) on every "
            "rank and torch.save(state, f) on rank 0; or copy.deepcopy(model) on every rank (the dense model), "
            "then pickle the copy")
    if ep_place.placement_of(model) is not None:
        raise RuntimeError(
            "pickling a model parallelized with ep=K (torch.save(model) or pickle.dumps): each rank holds only its "
            "experts of each layer, and pickling does not communicate. Save with autodist.save(path, model, "
            "optimizer) or model.state_dict() (collectives: every rank calls them, and they hold every expert), or "
            "copy.deepcopy(model) on every rank (the whole model), then pickle the copy")
    if sharding is not None and sharding.pins == 0:
        raise RuntimeError(
            "pickling a model parallelized with shard='parameters' (torch.save(model) or pickle.dumps): each rank "
            "holds 1/N of every parameter between steps, and pickling does not communicate. Save with "
            "autodist.save(path, model, optimizer) or model.state_dict() (collectives: every rank calls them), "
            "or pickle inside `with autodist.full_parameters(model):` (entered on every rank)")


def plain(model: nn.Module, memo: dict, split: nn.Module | str | None, everyone: Any, clone: bool) -> nn.Module:
    """The ordinary module (see the module docstring): its tensors copies (``clone``) or, for pickling, the
    model's own."""
    if split is not None:
        return _dense(model, split, everyone)
    with sharded_parameters.gathered(model, "copy.deepcopy(model)"), _aside(model), \
            ep_place.whole_for_copy(model, memo):  # never pickled: _check_picklable refuses it
        if not clone:  # the weights as they are: a Parameter without autodist's hooks around the same tensor
            for p in model.parameters():
                memo.setdefault(id(p), nn.Parameter(p.detach(), requires_grad=p.requires_grad))
        return copy.deepcopy(model, memo)


def _dense(model: nn.Module, split: nn.Module | str, everyone: Any) -> nn.Module:
    """The model as passed to ``parallelize``, holding the gathered weights of its split layers."""
    if isinstance(split, str):
        raise RuntimeError(f"copy.deepcopy of a model split by mp: {split}; take autodist.gather_state_dict(model) "
                           f"and load it into a model you build instead")
    with waiting("copy.deepcopy(model) of a model split by mp gathers its layers: a collective, call it on every "
                 "rank"):
        dist.barrier(group=everyone)  # every rank is here: the gathers below meet no forward
        state = gather_state_dict(model, all_ranks=True)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dense = copy.deepcopy(split).to_empty(device=device)
    live, persistent = dict(model.named_buffers()), set(dense.state_dict())
    with torch.no_grad():
        for name, b in dense.named_buffers():  # those the state dict leaves out (non-persistent): the model's own
            if name in persistent:
                continue
            if name not in live or live[name].shape != b.shape:
                raise RuntimeError(f"copy.deepcopy of a model split by mp: its non-persistent buffer {name!r} is "
                                   f"not in the split model; take autodist.gather_state_dict(model) and load it "
                                   f"into a model you build instead")
            b.copy_(live[name])
    dense.load_state_dict(state, strict=True)
    return dense


@contextmanager
def _aside(model: nn.Module) -> Iterator[None]:
    """autodist's hooks and the two entries set aside for the duration (every module's hook dicts filtered),
    the blocks' checkpointed forwards too (``checkpoint=True``) and BatchNorm's global one, and the model's own
    class back."""
    entries = {k: model.__dict__.pop(k) for k in _ENTRIES if k in model.__dict__}
    saved: list[tuple[nn.Module, str, Any]] = []
    adopted, model.__class__ = model.__class__, habits.own_class(model)  # the copy is of the user's class
    try:
        for module in model.modules():
            if is_recomputing(module.__dict__.get("forward")) or batch_norm.is_global(module.__dict__.get("forward")):
                saved.append((module, "forward", module.__dict__.pop("forward")))
            gone: set[int] = set()
            for attr in _HOOKS:
                hooks = getattr(module, attr, None)
                if not hooks:
                    continue
                mine = [k for k, hook in hooks.items() if _ours(hook)]
                if mine:
                    saved.append((module, attr, hooks))
                    setattr(module, attr, type(hooks)((k, h) for k, h in hooks.items() if k not in mine))
                    gone.update(mine)
            for attr in _BY_ID if gone else ():
                ids = getattr(module, attr, None)
                if ids:
                    saved.append((module, attr, ids))
                    setattr(module, attr, type(ids)((k, v) for k, v in ids.items() if k not in gone))
        yield
    finally:
        for module, attr, hooks in reversed(saved):
            module.__dict__[attr] = hooks
        model.__dict__.update(entries)
        model.__class__ = adopted


def _ours(hook: Any) -> bool:
    """Whether a hook is autodist's: its code lives in the autodist package (through partials, bound
    methods and torch's wrappers)."""
    for _ in range(8):
        if isinstance(hook, functools.partial):
            hook = hook.func
        elif hasattr(hook, "__func__"):
            hook = hook.__func__
        elif hasattr(hook, "hook") and type(hook).__name__ == "_WrappedHook":
            hook = hook.hook
            hook = hook() if isinstance(hook, weakref.ref) else hook
        else:
            break
    module = getattr(hook, "__module__", None) or type(hook).__module__
    return isinstance(module, str) and (module == "autodist" or module.startswith("autodist."))
