"""``AutodistStrategy``: Lightning's Trainer with ``autodist.parallelize`` in place of DDP.

Lightning calls the strategy at fixed points; each one does what the single-process script with
``parallelize`` would do at that point:

* ``Trainer(...)``: ``set_world_ranks`` joins the ranks (``autodist.init``) and checks ``devices`` and
  ``num_nodes`` against what the launcher started; ``rank_zero_only`` learns the rank.
* ``setup``: the LightningModule is parallelized (once per module: a second ``fit`` or ``validate`` reuses
  it), before ``configure_optimizers`` runs, as parallelize wants the optimizer built after it.
* each DataLoader (``process_dataloader``): this rank's slice of every global batch (``autodist.api.shard_data``),
  instead of the DistributedSampler Lightning injects for DDP; ``batch_to_device`` tells autodist which global
  batch a copied batch is part of.
* ``training_step`` runs through the module's ``__call__``, so that autodist's forward hooks count the batch
  whatever the step calls inside; ``block_backward_sync`` (accumulation) is ``autodist.no_sync``.
* ``optimizer_step``: with sharded state the closure (forward, backward, the sync) runs before the step, whose
  hooks then cut the fresh gradients into each rank's slices.
* checkpoints: the model's and the optimizers' state is dense (the single-process state, any layout gathered)
  when Lightning saves, and cut to this rank's layout when it loads: a checkpoint resumes at any world size,
  or in a plain single-process Lightning run.
"""
from __future__ import annotations

import inspect
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Literal, Mapping, TypeVar

import torch
from lightning.fabric.utilities.distributed import ReduceOp, _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from autodist.api import parallelize, shard_data
from autodist.dp.data import ShardedLoader
from autodist.dp.grad_sync import is_parallelized, no_sync, registration_of
from autodist.lightning import collectives
from autodist.lightning.environment import AutodistEnvironment
from autodist.mp.gather import gather_state_dict
from autodist.runtime import provenance
from autodist.runtime.tree import tensor_leaves
from autodist.runtime.world import World, init, world_size
from autodist.sharded.optimizer import sharding_of
from autodist.train.checkpoint import (dense_optimizer_state_dict, load_dense_optimizer_state_dict,
                                       load_dense_state_dict)

T = TypeVar("T")

# The modules a strategy parallelized, with the options it used: a module is laid out once, and a later fit,
# validate or test (a new Trainer with an equal strategy) finds it laid out already.
_laid_out: "weakref.WeakKeyDictionary[nn.Module, dict[str, Any]]" = weakref.WeakKeyDictionary()


def _parallelize_options() -> set[str]:
    return {name for name, p in inspect.signature(parallelize).parameters.items() if p.kind is p.KEYWORD_ONLY}


class AutodistStrategy(ParallelStrategy):
    """Lightning's Trainer trains through ``autodist.parallelize``: the same training as one process, over the
    ranks that ``autodist run`` (or torchrun, mpirun, Slurm's srun) started.

    Args:
        mp: model-parallel degree (the Linear layers split over groups of ``mp`` ranks), as for ``parallelize``.
        shard: None, "optimizer", "gradients" or "parameters": the state each data-parallel rank keeps a slice
            of, as for ``parallelize``.
        checkpoint: recompute each block's activations in backward, as for ``parallelize``.
        backend: "gloo", "nccl" or None: chosen by ``autodist.init`` (gloo with ``accelerator="cpu"``).
        **options: any other keyword argument of ``autodist.parallelize`` (``bucket_mb``, ``mp_layers``,
            ``example``, ``batch_dim``, ``sync``...). With ``mp > 1`` and no ``example``, the module's
            ``example_input_array`` (if set) plans the split of a model torch.fx cannot trace.

    Example:
        >>> # autodist run -n 4 train.py
        >>> trainer = lightning.Trainer(strategy=AutodistStrategy(mp=2, shard="optimizer"), devices=4,
        ...                             accelerator="cpu", max_epochs=3)
        >>> trainer.fit(module, train_loader)     # the plain DataLoader: each rank gets its slices

    Note:
        ``devices`` is the number of ranks the launcher started on each node and ``num_nodes`` the number of
        nodes: Lightning starts no process. The DataLoaders stay the single-process ones: Lightning's
        DistributedSampler is never injected (``use_distributed_sampler`` is ignored); a DataLoader over an
        IterableDataset (or any other iterable) is left as it is, for the script to split by
        ``trainer.global_rank``, as under DDP. ``self.log(..., sync_dist=True)`` reduces over the
        data-parallel ranks (the ranks of one model-parallel group hold the same values); ``all_gather``
        gathers from every rank. The module is laid out once, at its first setup, after the precision plugin set
        its dtype: it stays on its device after a run (Lightning moves it to the CPU), and a later ``fit``,
        ``validate`` or ``test`` with an equal strategy trains or evaluates it as it is.
    """

    def __init__(self, *, mp: int = 1, shard: Literal["optimizer", "gradients", "parameters"] | None = None,
                 checkpoint: bool = False, backend: Literal["gloo", "nccl"] | None = None, **options: Any) -> None:
        unknown = sorted(set(options) - _parallelize_options())
        if unknown:
            raise TypeError(f"AutodistStrategy got unknown options {unknown}; it takes the keyword arguments of "
                            f"autodist.parallelize: {sorted(_parallelize_options())}")
        super().__init__(cluster_environment=AutodistEnvironment())
        self._options = {"mp": mp, "shard": shard, "checkpoint": checkpoint, **options}
        self._backend = backend
        self._num_nodes = 1
        self._checkpoint_path: str | None = None  # the file being loaded, for errors

    def __repr__(self) -> str:
        defaults = {"mp": 1, "shard": None, "checkpoint": False}
        given = ", ".join(f"{k}={v!r}" for k, v in self._options.items() if k not in defaults or v != defaults[k])
        return f"AutodistStrategy({given})"

    # -- the ranks -------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def _environment(self) -> AutodistEnvironment:
        assert isinstance(self.cluster_environment, AutodistEnvironment)
        return self.cluster_environment

    @property
    def is_distributed(self) -> bool:
        """Lightning syncs ``self.log(..., sync_dist=True)`` only for a strategy that says it is distributed."""
        return self._environment.bound and self.world.size > 1

    @property
    def world(self) -> World:
        """The ranks, joined when the Trainer was built (``autodist.init``), held by the cluster environment."""
        return self._environment.world

    def set_world_ranks(self) -> None:
        """Called by ``Trainer(...)`` once it knows the accelerator, ``devices`` and ``num_nodes``: join the ranks
        the launcher started and check that Lightning's idea of them is the same."""
        if not self._environment.bound:
            # NCCL needs GPUs; a CPU run keeps its tensors on the CPU, so it talks gloo even where GPUs exist
            backend = self._backend or ("gloo" if isinstance(self.accelerator, CPUAccelerator) else None)
            self._environment.bind(init(backend if world_size() > 1 else None))  # a world of one: no backend
        self._check_devices(self.world)
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.world.rank  # (one object in Lightning >= 2.1)

    def _check_devices(self, world: World) -> None:
        devices = list(self.parallel_devices or [])
        if len(devices) != world.local_size or self.num_nodes * len(devices) != world.size:
            asked = (f"Trainer(devices={len(devices)}, num_nodes={self.num_nodes}) asks for {len(devices)} rank(s) "
                     f"on each of {self.num_nodes} node(s), and with AutodistStrategy Lightning starts no process")
            if world.size == 1 and world.launcher == "none":
                raise ValueError(f"{asked}, but this process was started alone, without a launcher: start the "
                                 f"script with `autodist run -n {len(devices) * self.num_nodes} train.py` (or "
                                 f"torchrun, mpirun, srun), or pass devices=1 to train in this one process")
            started = "the process group holds" if world.launcher == "none" else \
                f"the launcher ({world.launcher}) started"
            raise ValueError(f"{asked}, but {started} {world.size} rank(s), {world.local_size} on this node: pass "
                             f"devices={world.local_size} and "
                             f"num_nodes={world.size // world.local_size}")
        device = devices[world.local_rank]
        if device.type == "cuda" and device != world.device:
            raise ValueError(f"Lightning would train local rank {world.local_rank} on {device}, but autodist "
                             f"pinned it to {world.device} (GPUs go to the local ranks in order): pass "
                             f"devices={world.local_size} rather than a list of GPUs")

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world.size, "rank": self.world.rank}

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- the model ---------------------------------------------------------------------------------------
    def setup(self, trainer: Any) -> None:
        """Lightning's Strategy.setup, but a module laid out already keeps its dtype and device."""
        # autodist shards each DataLoader itself (process_dataloader); Lightning's DistributedSampler on top
        # would split every rank's slice again
        trainer._accelerator_connector.use_distributed_sampler = False
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.lightning_module not in _laid_out:  # dtype and device go before parallelize, which fixes them
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
        self.model = self._setup_model(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)  # configure_optimizers after parallelize, over the split parameters
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        module = self.lightning_module  # model is the module itself: nothing wraps it (no DDP)
        assert module is not None
        before = _laid_out.get(module)
        if before is not None:
            if not _same_layout(before, self._options):
                raise ValueError(f"{type(module).__name__} was parallelized by AutodistStrategy with {before}, "
                                 f"which this one ({self._options}) cannot change: a model is laid out once; build "
                                 f"the module again for another layout, or use an equal strategy")
            return model
        if is_parallelized(module):
            raise ValueError(f"{type(module).__name__} was passed to autodist.parallelize already; under "
                             f"AutodistStrategy the strategy parallelizes the module at the Trainer's setup: drop "
                             f"the call, and give the options to AutodistStrategy(...)")
        options = dict(self._options)
        if options["mp"] > 1 and self.world.size > 1:  # in a world of one the script runs as it is
            _check_splittable(module)
            if options.get("example") is None and module.example_input_array is not None:
                options["example"] = module.example_input_array  # Lightning's own sample input: model(example)
        try:
            parallelize(module, None, **options)  # the world was joined at Trainer(...), with the backend
        except ValueError as err:
            if options["mp"] == 1 or "example" not in str(err):
                raise
            raise ValueError(f"{err}. Under AutodistStrategy: set self.example_input_array in "
                             f"{type(module).__name__}.__init__ (a batch's inputs, as training_step gives them to "
                             f"self(...)), or pass AutodistStrategy(mp={options['mp']}, example=...)") from err
        _laid_out[module] = dict(self._options)
        return model

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Through the module's __call__, as DDP's wrapper is called: autodist's forward hooks then count the batch
        # that this step's backward is weighted by, also when the step calls a submodule (self.net(x)).
        module = self.lightning_module
        assert module is not None
        with self.precision_plugin.train_step_context():
            return self._forward_redirection(module, module, "training_step", *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation steps: the backwards add up locally; the step's last backward syncs."""
        assert self.lightning_module is not None
        with no_sync(self.lightning_module):
            yield

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: nn.Module | None = None, **kwargs: Any) -> Any:
        if sharding_of(self.lightning_module) is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        with _closure_first(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    # -- the data ----------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        if isinstance(dataloader, ShardedLoader):
            raise ValueError("this DataLoader is already one rank's shard (returned by autodist.parallelize); give "
                             "the Trainer the plain single-process DataLoader: AutodistStrategy shards it")
        if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
            return dataloader  # a stream autodist cannot split by index: the script splits it, as under DDP
        assert self.lightning_module is not None
        return shard_data(self.lightning_module, dataloader, batch_dim=self._options.get("batch_dim"))

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        share = _share_of(batch)
        moved = super().batch_to_device(batch, device, dataloader_idx)
        if share is not None:
            # A copy (on the GPU) is new memory, and from a loader without len() Lightning fetches the next batch
            # before this one's step: say which global batch this step trains on, for the forward's sample count.
            provenance.register_batch(moved, share)
            provenance.announce(share)
        return moved

    # -- checkpoints ---------------------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The dense state dict, the original module's names and shapes, on every rank (a collective)."""
        assert self.lightning_module is not None
        return gather_state_dict(self.lightning_module, all_ranks=True)  # type: ignore[return-value]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's dense state in torch's format, as one process holds it (a collective)."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        return dense_optimizer_state_dict(optimizer, self.lightning_module)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._checkpoint_path = str(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        where = "the checkpoint" if self._checkpoint_path is None else f"the checkpoint {self._checkpoint_path!r}"
        load_dense_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict, where=where)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_dense_optimizer_state_dict(optimizer, self.lightning_module, state)
            _optimizer_to_device(optimizer, self.root_device)

    def teardown(self) -> None:
        """Lightning's teardown, but the module stays where parallelize laid it out (Lightning moves it to the CPU):
        its parameters at rest (``shard="parameters"``) and its gradients (``"gradients"``) are each rank's slices,
        which refuse to move, and the next fit, validate or test finds it in place."""
        assert self.cluster_environment is not None and self.accelerator is not None
        provenance.announce(None)  # the last batch_to_device's batch is no longer this thread's current one
        self.cluster_environment.teardown()
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # -- collectives -------------------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        collectives.barrier(self.world)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return collectives.broadcast(obj, src, self.world)

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``self.log(..., sync_dist=True)``: over the data-parallel ranks unless a group is given (the ranks of a
        model-parallel group hold the same values: a sum over every rank would count them ``mp`` times)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        registration = None if self.lightning_module is None else registration_of(self.lightning_module)
        if group is None and registration is not None:
            if registration.dp == 1:  # one data-parallel rank (mp = world size): its value is the whole batch's
                return tensor
            group = registration.dp_group  # None: the whole world
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = _sync_ddp_if_available(torch.tensor(int(decision), device=self.root_device), None,
                                       reduce_op=ReduceOp.SUM)  # every rank votes
        return bool(votes == self.world_size) if all else bool(votes)


def _same_layout(before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two strategies' options lay a module out alike (``example``, a sample batch, only plans it)."""
    keys = (before.keys() | now.keys()) - {"example"}
    try:
        return all(before.get(k) is now.get(k) or bool(before.get(k) == now.get(k)) for k in keys)
    except (RuntimeError, TypeError, ValueError):  # values that do not compare (tensors): not the same
        return False


def _check_splittable(module: nn.Module) -> None:
    """mp > 1 splits the layers the module's forward runs; a LightningModule without one has nothing to follow."""
    if type(module).forward is LightningModule.forward:
        raise ValueError(f"AutodistStrategy(mp > 1) splits the layers that {type(module).__name__}.forward runs, "
                         f"and it has no forward (its training_step calls the layers itself): define "
                         f"forward(self, x) running them and call self(x) in training_step")


def _share_of(batch: Any) -> provenance.BatchShare | None:
    """The global batch a batch from a sharded DataLoader is part of (None for other data)."""
    for _, leaf in tensor_leaves(batch):
        share = provenance.known_share(leaf)
        if isinstance(share, provenance.BatchShare):
            return share
    return None


@contextmanager
def _closure_first(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer.step(closure)`` runs the closure (forward, backward, the gradient sync) first and then the step.

    Lightning hands its closure to ``step``, which runs it inside, after the step's pre-hooks; with sharded state
    those hooks swap each parameter for this rank's slice of it and of its gradient, which must exist by then.
    """
    step = optimizer.step  # the class's hooked step, bound
    own = optimizer.__dict__.get("step")

    def closure_first(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = None if closure is None else closure()
        step(**kwargs)
        return result

    optimizer.step = closure_first  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del optimizer.step
        else:
            optimizer.step = own  # type: ignore[method-assign]
