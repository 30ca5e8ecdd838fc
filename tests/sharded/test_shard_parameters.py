"""shard="parameters": parameters sharded at rest, each block gathered for its forward and its backward and
freed after, the next block gathered meanwhile; blocks found in outside models or named by hand; forwards
without backward (evaluation, validation without no_grad) between steps; ranks that run different layers
refused before anything is stepped. The exactness tests of every level are in test_sharded_training.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import autodist
import workloads as w
from autodist.sharded import blocks
from autodist.sharded.parameters import sharding_of
from outside.nanogpt import GPT, GPTConfig
from outside.word_language_model import RNNModel
from test_sharded_training import _outside


def test_the_blocks_of_outside_models_are_their_repeated_layers():
    nanogpt = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=3, n_head=2, n_embd=8, dropout=0.0))
    found = {kind: [name for name, _ in blocks.find(_outside(kind))] for kind in ("gpt2", "llama", "encoder")}
    assert [name for name, _ in blocks.find(nanogpt)] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert found == {"gpt2": ["transformer.h.0", "transformer.h.1"], "llama": ["model.layers.0", "model.layers.1"],
                     "encoder": ["1.layers.0", "1.layers.1"]}
    assert [name for name, _ in blocks.find(w.mlp())] == ["0", "2", "4"]  # an MLP's Linear layers
    rnn = RNNModel("LSTM", 20, 8, 8, 2)
    assert blocks.find(rnn) == []  # nothing repeated: everything is the root (parallelize warns)
    assert [n for n, _ in blocks.find(rnn, ["rnn", "decoder"])] == ["rnn", "decoder"]
    assert [n for n, _ in blocks.find(nanogpt, lambda name, m: type(m).__name__ == "Block")] == \
        ["transformer.h.0", "transformer.h.1", "transformer.h.2"]  # a callable sees every module


class BasicBlock(nn.Module):
    """A ResNet block (two 3x3 convolutions and a shortcut, a 1x1 one where the shape changes), as torchvision
    builds them."""

    def __init__(self, into: int, out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(into, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out)
        self.conv2, self.bn2 = nn.Conv2d(out, out, 3, 1, 1, bias=False), nn.BatchNorm2d(out)
        self.downsample = None if stride == 1 and into == out else \
            nn.Sequential(nn.Conv2d(into, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


def _stage(into: int, out: int, count: int) -> nn.Sequential:
    first = BasicBlock(into, out, 1 if into == out else 2)
    return nn.Sequential(first, *[BasicBlock(out, out) for _ in range(count - 1)])


class ResNet(nn.Module):
    """torchvision's ResNet layout: a stem, layer1..layer4 (each a Sequential of blocks), a pool and a head."""

    def __init__(self, counts: tuple[int, ...] = (2, 2, 2, 2)) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8)
        widths = [8, 8, 16, 32, 64]
        for i, count in enumerate(counts):
            setattr(self, f"layer{i + 1}", _stage(widths[i], widths[i + 1], count))
        self.fc = nn.Linear(64, 10)


def test_blocks_are_found_in_the_shapes_people_write():
    """A run of repeated members with members of other types before or after it (a stem, a pool, a head), blocks
    one level down, ResNet's stages of blocks; what no run holds is the root."""
    def found(model: nn.Module) -> list[str]:
        return [name for name, _ in blocks.find(model)]

    def tanh_block() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    assert found(nn.Sequential(*[tanh_block() for _ in range(4)], nn.Linear(8, 3))) == ["0", "1", "2", "3"]
    assert found(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), *[tanh_block() for _ in range(3)],
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.LayerNorm(8), nn.Linear(8, 3))) == \
        ["3", "4", "5"]  # Sequential(stem, *blocks, pool, head)
    vgg = nn.Module()
    vgg.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.MaxPool2d(2))
    vgg.classifier = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 3))
    assert found(vgg) == ["features.0", "features.2", "classifier.0", "classifier.3"]
    resnet = ResNet((2, 3, 2, 2))
    assert found(resnet) == [f"layer{i}.{j}" for i, n in zip(range(1, 5), (2, 3, 2, 2)) for j in range(n)]
    # the same stages in one Sequential with the stem and head: each stage's blocks, not the stages whole
    flat = nn.Sequential(resnet.conv1, resnet.bn1, resnet.layer1, resnet.layer3, resnet.layer4,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), resnet.fc)
    assert found(flat) == ["2.0", "2.1", "3.0", "3.1", "4.0", "4.1"]
    # two different containers are no run; their blocks are found inside each
    mixed = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
    assert found(mixed) == ["0.0", "0.1"]
    bert = pytest.importorskip("transformers").BertModel(pytest.importorskip("transformers").BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=30))
    assert found(bert) == ["encoder.layer.0", "encoder.layer.1"]


def test_where_no_block_is_found_the_warning_says_what_was_looked_for_and_how_to_name_them():
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 3))
    said = blocks.none_found(plain, "shard='parameters'")
    assert "found no blocks in Sequential" in said and "runs of two or more consecutive members of one type" in said
    assert "blocks=['0', '1', '2']" in said


def test_blocks_that_nest_or_do_not_exist_are_clear_errors():
    nanogpt = GPT(GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=8, dropout=0.0))
    with pytest.raises(ValueError, match="'transformer.h.0' and 'transformer.h.0.attn': one holds the other"):
        blocks.find(nanogpt, ["transformer.h.0", "transformer.h.0.attn"])
    with pytest.raises(ValueError, match="'transformer.h.9', which is not a submodule of GPT"):
        blocks.find(nanogpt, ["transformer.h.9"])
    with pytest.raises(TypeError, match="list of module names or a callable"):
        blocks.find(nanogpt, "transformer.h")
    with pytest.raises(ValueError, match="blocks= names the modules shard='parameters' gathers"):
        autodist.parallelize(nanogpt, blocks=["transformer.h.0"], shard="gradients")


class Stack(nn.Module):
    """Four equal blocks between an input and an output layer (the root); ``order`` permutes the blocks."""

    def __init__(self, order: tuple[int, ...] = (0, 1, 2, 3)) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 32), nn.Linear(32, 3)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i in self.order:
            h = self.layers[i](h)
        return self.out(h)


def _in_use():
    """How many blocks are gathered while each block runs forward and while each gradient lands, what a rank
    holds between steps, and whether the next block was on its way while the current one ran."""
    torch.manual_seed(0)
    model, _ = autodist.parallelize(Stack(), shard="parameters")
    at_rest = sharding_of(model)
    forward, backward, prefetched = [], [], []

    def gathered() -> int:
        return sum(b.full is not None for b in at_rest.blocks if b is not at_rest.root)

    def running(module, args):
        block = at_rest.by_module[id(module)]
        forward.append(gathered())
        following = at_rest.next_of.get(block)
        if following is not None:
            prefetched.append(following.full is not None)

    for layer in model.layers:
        layer.register_forward_pre_hook(running)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: backward.append(gathered()))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kept = []  # what autograd saved of a running block's parameters: a tensor would keep the block alive
    pack = at_rest._pack

    def saving(t):
        block = at_rest.hooking[-1][1]
        aliases = t.untyped_storage().data_ptr() == block.full.untyped_storage().data_ptr()
        saved = pack(t)
        if aliases:
            kept.append(torch.is_tensor(saved))
        return saved

    at_rest._pack = saving
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(4, 6)), torch.zeros(4, dtype=torch.long)).backward()
        opt.step()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    storage = sum(p.untyped_storage().nbytes() for p in model.parameters())
    placeholders = 4 * len(list(model.parameters()))  # one float32 each
    return forward, backward, prefetched, kept, at_rest.held_bytes(), whole, storage <= placeholders, \
        len(at_rest.blocks)


def test_a_rank_holds_its_shard_and_the_blocks_in_use_and_the_next_block_is_gathered_meanwhile(ranks):
    for forward, backward, prefetched, kept, held, whole, placeholders, count in ranks(2, _in_use):
        assert count == 5  # the four layers and the root
        assert max(forward) <= 2 and max(backward) <= 3, (forward, backward)  # never the whole model
        assert prefetched and all(prefetched), prefetched  # from the second forward on
        assert len(kept) >= 4 * 3 and not any(kept), kept  # autograd keeps where a weight was, not the weight
        assert held <= whole / 2 + 4 * count  # between steps: 1/N (each block padded to N parts)
        assert placeholders  # parameters hold one-number placeholders at rest


@w.float64
def _evaluating():
    """Training steps with an evaluation under no_grad and a validation forward with gradients enabled (and no
    backward) between them: the same parameters and the same evaluations as one process."""
    x, y = w.digits_like(48, features=6, classes=3)
    ref = w.seeded(Stack, 0)
    model, (xs, ys) = autodist.parallelize(w.seeded(Stack, 100 * w.rank()), (x, y), shard="parameters")
    n = torch.distributed.get_world_size()
    evaluations = {}
    for m, (xd, yd) in ((ref, (x, y)), (model, (xs, ys))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        seen = evaluations.setdefault(id(m), [])
        size = 12 if m is ref else 12 // n
        for i in range(0, len(xd), size):
            opt.zero_grad()
            F.cross_entropy(m(xd[i:i + size]), yd[i:i + size]).backward()
            opt.step()
            with torch.no_grad():
                seen.append(m(x[:5]))
            seen.append(m(x[5:9]).detach())  # validation without no_grad: no backward follows
    return w.state(ref), w.state(model), evaluations[id(ref)], evaluations[id(model)]


def test_evaluation_and_validation_without_no_grad_between_steps(ranks):
    for ref, par, ref_evals, evals in ranks(2, _evaluating):
        assert_close(par, ref, rtol=1e-12, atol=1e-14)
        assert_close(evals, ref_evals, rtol=1e-12, atol=1e-14)


@w.float64
def _rnn():
    """The word_language_model LSTM ((seq, batch) inputs), its blocks named by hand."""
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (8, 7))

    def build():
        return RNNModel("LSTM", 20, 8, 8, 2, dropout=0.0)

    def loss_of(m, batch):
        out, _ = m(batch.t(), m.init_hidden(batch.shape[0]))
        return F.nll_loss(out, batch.t().roll(-1, 0).reshape(-1))

    ref = w.seeded(build, 0)
    model, (mine,) = autodist.parallelize(w.seeded(build, 100 * w.rank()), (ids,), shard="parameters",
                                          blocks=["rnn", "decoder"])
    for m, batch in ((ref, ids), (model, mine)):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            loss_of(m, batch).backward()
            opt.step()
    return w.state(ref), w.state(model), [b.name for b in sharding_of(model).blocks]


def test_an_lstm_with_blocks_named_by_hand_trains_as_one_process(ranks):
    for ref, par, names in ranks(2, _rnn):
        assert names == ["rnn", "decoder", "(root)"]
        assert_close(par, ref, rtol=1e-12, atol=1e-14)


@w.float64
def _stem_blocks_head(options: dict):
    """Sequential(stem, *blocks, norm, head) on a conv stem, under shard="parameters" (and checkpoint=True): the
    blocks are the run, the stem, norm and head the root. GroupNorm: BatchNorm in training mode normalizes by
    each rank's own rows (docs/data-parallel.md), which is no test of the blocks."""
    x, y = w.digits_like(24, features=16)
    x = x.view(-1, 1, 4, 4)

    def build():
        blocks = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)]
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                             nn.Flatten(), *blocks, nn.LayerNorm(16), nn.Linear(16, 3))

    ref = w.seeded(build, 0)
    model, loader = autodist.parallelize(w.seeded(build, 100 * w.rank()), w.loader(x, y, 8), **options)
    for m, batches in ((ref, w.loader(x, y, 8)), (model, loader)):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for xb, yb in batches:
            opt.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            opt.step()
    return w.state(ref), w.state(model), [b.name for b in sharding_of(model).blocks]


@pytest.mark.parametrize("options", [{"shard": "parameters"}, {"shard": "parameters", "checkpoint": True}],
                         ids=["parameters", "parameters-checkpoint"])
def test_blocks_between_a_stem_and_a_head_train_as_one_process(ranks, options):
    for ref, par, names in ranks(2, _stem_blocks_head, options):
        assert names == ["5", "6", "7", "(root)"]
        assert_close(par, ref, rtol=1e-12, atol=1e-14)


class Checkpointed(Stack):
    """Stack with each block under torch.utils.checkpoint (non-reentrant) around its call, hooks included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for i in self.order:
            h = torch.utils.checkpoint.checkpoint(self.layers[i], h, use_reentrant=False)
        return self.out(h)


@w.float64
def _checkpointing(kind: str):
    """Activation checkpointing: Hugging Face's (inside each block's hooks: the recomputation in backward must
    find the block gathered) and torch's around each block's call (the recomputation gathers it again)."""
    if kind == "hugging face":
        def build():
            m = _outside("gpt2")
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return m
        data = torch.randint(0, 50, (6, 9), generator=torch.Generator().manual_seed(4))

        def loss_of(m, ids):
            logits = m(input_ids=ids).logits
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    else:
        build, data = Checkpointed, w.digits_like(12, features=6, classes=3)

        def loss_of(m, batch):
            return F.cross_entropy(m(batch[0]), batch[1])
    ref = w.seeded(build, 0)
    model, mine = autodist.parallelize(w.seeded(build, 100 * w.rank()), data, shard="parameters")
    for m, batch in ((ref, data), (model, mine)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            loss_of(m, batch).backward()
            opt.step()
    return w.state(ref), w.state(model)


@pytest.mark.parametrize("kind", ["hugging face", "torch around the block"])
def test_activation_checkpointing_trains_as_one_process(ranks, kind):
    for ref, par in ranks(2, _checkpointing, kind):
        assert_close(par, ref, rtol=1e-10, atol=1e-12)


def _different_layers():
    torch.manual_seed(0)
    order = (0, 1, 2, 3) if w.rank() == 0 else (1, 0, 2, 3)  # rank 1 runs its first two blocks swapped
    model, _ = autodist.parallelize(Stack(order), shard="parameters")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = w.state(model)
    try:
        F.cross_entropy(model(torch.randn(4, 6)), torch.zeros(4, dtype=torch.long)).backward()
        opt.step()
        return "no error", False
    except RuntimeError as e:
        return str(e), w.state(model).keys() == before.keys() and \
            all(torch.equal(a, b) for a, b in zip(w.state(model).values(), before.values()))


def test_ranks_that_run_different_layers_are_refused_before_the_step(ranks):
    for message, unchanged in ranks(2, _different_layers):
        assert "gathered different blocks" in message and "shard='gradients'" in message, message
        assert unchanged


def _frozen(stack: Stack) -> Stack:
    """Fine-tuning: the input layer trains, the first three blocks are a frozen base (gradients flow through
    them to the input layer), the last block trains one of its two tensors (an adapter's way), the head trains."""
    for layer in stack.layers[:3]:
        layer.requires_grad_(False)
    stack.layers[3][0].bias.requires_grad_(False)
    return stack


@w.float64
def _fine_tuned():
    """shard="parameters" with frozen parameters: the same training as one process, the frozen base sharded at
    rest too (a rank holds 1/N of it), and never more than the blocks in use gathered in backward."""
    x, y = w.digits_like(48, features=6, classes=3)
    ref = _frozen(w.seeded(Stack, 0))
    model, (xs, ys) = autodist.parallelize(_frozen(w.seeded(Stack, 100 * w.rank())), (x, y), shard="parameters")
    at_rest = sharding_of(model)
    gathered = []
    for p in model.inp.parameters():  # the gradient of the input layer lands after every block's backward
        p.register_post_accumulate_grad_hook(
            lambda p: gathered.append(sum(b.full is not None for b in at_rest.blocks if b is not at_rest.root)))
    n = torch.distributed.get_world_size()
    for m, (xd, yd) in ((ref, (x, y)), (model, (xs, ys))):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        size = 12 if m is ref else 12 // n
        for i in range(0, len(xd), size):
            opt.zero_grad()
            F.cross_entropy(m(xd[i:i + size]), yd[i:i + size]).backward()
            opt.step()
    frozen = sum(p.numel() * p.element_size() for p in ref.parameters() if not p.requires_grad)
    held = sum(part.shard.numel() * part.shard.element_size() for b in at_rest.blocks for part in b.parts
               if not part.params[0].requires_grad)
    return w.state(ref), model.state_dict(), frozen, held, gathered, [len(b.parts) for b in at_rest.blocks]


def test_frozen_parameters_are_sharded_gathered_for_use_and_never_reduced(ranks):
    for ref, par, frozen, held, gathered, parts in ranks(2, _fine_tuned):
        assert_close(par, ref, rtol=1e-12, atol=1e-14)  # frozen ones unchanged, the others trained alike
        assert held <= frozen / 2 + 8 * 4, (held, frozen)  # 1/N of the frozen base (each part padded to N chunks)
        assert parts == [1, 1, 1, 2, 1], parts  # frozen blocks; the last one trainable and frozen; the root
        assert gathered and max(gathered) <= 1, gathered  # the frozen blocks were freed after their backward
