"""What stands in a rank's model for a block another stage holds: no parameters, the block's place and names.

Called before this stage's own blocks, it hands on what the stage before sent (the output of the block before
this stage's first). What the model's code reads of a block (``layers[0].self_attn.batch_first``) comes from
the block's skeleton on the meta device. Its entries of ``state_dict`` are its owner's (:mod:`autodist.pp.pipeline` fills them in,
a collective over the stages), and ``load_state_dict`` checks them and leaves them to the owner.

Example:
    >>> model.transformer.h[3]
    Stub(transformer.h.3: held by stage 1)
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class Stub(nn.Module):
    """A block held by another stage of the pipeline (see the module docstring)."""

    def __init__(self, index: int, name: str, stage: int, skeleton: nn.Module, called: Callable[[int], Any]) -> None:
        super().__init__()
        self.index, self.block_name, self.stage = index, name, stage
        self.__dict__["skeleton"] = skeleton  # the block on the meta device: its names and shapes, no memory
        self.__dict__["called"] = called

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:  # what the model's code reads of its blocks (a flag, a submodule's setting)
            skeleton = self.__dict__.get("skeleton")
            if skeleton is None:
                raise
            return getattr(skeleton, name)

    @torch.compiler.disable  # it receives from another stage: outside compiled graphs (one per stub, not traced)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.called(self.index)

    def extra_repr(self) -> str:
        return f"{self.block_name}: held by stage {self.stage}"

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for key, value in self.skeleton.state_dict(keep_vars=keep_vars).items():
            destination[prefix + key] = value  # on the meta device: the pipeline's hook puts the owner's values in

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        expected = self.skeleton.state_dict()
        for key, value in expected.items():
            given = state_dict.get(prefix + key)
            if given is None:
                missing_keys.append(prefix + key)
            elif hasattr(given, "shape") and tuple(given.shape) != tuple(value.shape):
                error_msgs.append(f"size mismatch for {prefix + key}: copying a param with shape "
                                  f"{tuple(given.shape)} from checkpoint, the shape in current model is "
                                  f"{tuple(value.shape)}.")
        unexpected_keys += [k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in expected]
