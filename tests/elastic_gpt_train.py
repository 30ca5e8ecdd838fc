"""nanoGPT (tests/outside/nanogpt.py) in float64 under ``autodist run --elastic``, a rank killed mid-backward: run by
tests/faults/test_elastic.py.

Usage: python elastic_gpt_train.py OUT KILL. KILL is "" or RANK:STEP: that rank SIGKILLs itself in the backward of
its loop's STEP-th iteration (counted from 0), when the gradient reaches the first block's attention, after the
later blocks' gradients. 90 sequences of 16 tokens in shuffled batches of 12 (the last of 6), AdamW with weight
decay, 2 epochs. Rank 0 writes OUT: the parameters. Run in one process (no launcher) it is the reference.
"""
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import autodist
from outside.nanogpt import GPT, GPTConfig

torch.set_default_dtype(torch.float64)


def main(out: str, kill: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (90, 17), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=12, shuffle=True)
    torch.manual_seed(5)
    model, loader = autodist.parallelize(model, loader)
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    rank, when = (int(k) for k in kill.split(":")) if kill else (-1, -1)
    taken = 0
    for _ in range(2):
        for x, y in loader:
            _, loss = model(x, y)
            if (taken, autodist.rank()) == (when, rank):
                model.transformer.h[0].attn.c_attn.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
            taken += 1
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    if autodist.rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
