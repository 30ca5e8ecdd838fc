"""A model pp cannot cut as it is, run on 2 ranks: the first forward fails with the error that names why.

Usage: autodist run -n 2 refused_forward.py CASE, CASE one of:
  residual        the model's own code adds a residual around each block (x = x + block(x))
  hidden-states   Hugging Face's GPT-2 asked for every block's hidden state (output_hidden_states=True)
  decoder         an encoder-decoder cut inside its decoder: the last stage's decoder block reads the encoder's
                  output, which only the first stage computes
"""
import sys

import torch
from torch import nn

import autodist


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.norm = nn.LayerNorm(4)
        self.decoder = nn.ModuleList(nn.Bilinear(4, 4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            x = block(x)
        memory, y = self.norm(x), x
        for block in self.decoder:
            y = block(y, memory)
        return y


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                      bos_token_id=0, eos_token_id=0, use_cache=False))


def main(case: str) -> None:
    torch.manual_seed(0)
    if case == "residual":
        model, _ = autodist.parallelize(Residual(), pp=2)
        model(torch.randn(4, 4)).sum().backward()
    elif case == "decoder":
        model, _ = autodist.parallelize(EncoderDecoder(), pp=2, stages=[3, 1])
        model(torch.randn(4, 4)).sum().backward()
    else:
        model, _ = autodist.parallelize(gpt2(), pp=2)
        ids = torch.randint(0, 32, (4, 8))
        model(input_ids=ids, labels=ids, output_hidden_states=True).loss.backward()


if __name__ == "__main__":
    main(sys.argv[1])
