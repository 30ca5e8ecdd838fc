"""Models and fixed batches of other shapes than the MLP, for ``bench_shapes.py``. Not a benchmark itself.

- ``TinyLM``: a pre-norm transformer language model (token and position
  embeddings, ``nn.TransformerEncoderLayer(batch_first=True, norm_first=True)``
  blocks with a causal mask, a final LayerNorm and an untied bias-free head):
  2 + 12 * layers + 2 + 1 parameter tensors, i.e. 29 for 2 layers, 149 for 12.
  Its forward returns the logits flattened to (batch * tokens, vocab), so the
  plain ``F.cross_entropy(model(x), y)`` step of ``timing.make_step`` applies.
- ``resnet20``: the CIFAR ResNet-20 (3 stages of 3 basic blocks, 16/32/64
  channels, BatchNorm, 1x1 projection shortcuts where the shape changes).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D_MODEL, HEADS, FEEDFORWARD, TOKENS = 1000, 128, 4, 512, 64
IMAGE, CLASSES = (3, 32, 32), 10


class TinyLM(nn.Module):
    """Pre-norm transformer LM; dropout 0, so that two copies fed alike compute the same."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.position = nn.Embedding(TOKENS, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FEEDFORWARD, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        # A plain attribute, not a buffer: DDP would broadcast a buffer at every forward.
        self.causal = nn.Transformer.generate_square_subsequent_mask(TOKENS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            h = block(h, src_mask=self.causal, is_causal=True)
        return self.head(self.norm(h)).transpose(1, 2)  # (batch, VOCAB, tokens): cross_entropy's layout


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet20() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(IMAGE[0], 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for cout, stride in ((16, 1), (32, 2), (64, 2)):
        for i in range(3):
            layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, CLASSES)]
    return nn.Sequential(*layers)


def build_lm(layers: int, seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(layers)


def build_resnet(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return resnet20()


def token_batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` random sequences of TOKENS tokens and their next-token targets, (size, TOKENS) each."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, TOKENS + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def image_batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, *IMAGE, generator=g), torch.randint(0, CLASSES, (size,), generator=g)
