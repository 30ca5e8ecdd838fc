"""A Hugging Face Trainer run, untouched by autodist: `autodist run -n 2` starts it and Trainer wraps the model in
DDP itself. tests/frameworks/test_hf_trainer.py runs it so and as one process with the per-device batch doubled.

usage: python hf_trainer_train.py OUT PER_DEVICE_BATCH

It trains a tiny GPT-2 (float64, no dropout) in three cases, one Trainer each, and writes OUT/CASE.pt (rank 0: the
final state_dict) and OUT/CASE.rankR.json (every rank: its optimizer steps and the world size Trainer saw).
"""
from __future__ import annotations

import json
import os
import sys

import torch
import transformers

# name: (examples, TrainingArguments of the case); the global batch is 6 (3 per rank on 2 ranks, 6 in one process)
CASES = {
    "even": (36, {}),                                      # 6 global batches of 6
    "padded": (40, {}),                                    # a last global batch of 4 that Accelerate pads to 6
    "drop_last": (40, {"dataloader_drop_last": True}),     # that last batch dropped, also in one process
}


class Tokens(torch.utils.data.Dataset):
    """The same seeded token sequences on every rank; the labels are the inputs (a causal LM shifts them)."""

    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out: str, name: str, per_device: int) -> None:
    examples, options = CASES[name]
    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # dropout differs per rank
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).double()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, name), per_device_train_batch_size=per_device, num_train_epochs=2,
        learning_rate=1e-2, seed=0, data_seed=1, use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False,
        **options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(examples))
    trainer.train()
    with open(os.path.join(out, f"{name}.rank{args.process_index}.json"), "w") as f:
        json.dump({"steps": trainer.state.global_step, "world": args.world_size}, f)
    if args.process_index == 0:
        torch.save(model.state_dict(), os.path.join(out, f"{name}.pt"))


if __name__ == "__main__":
    transformers.logging.set_verbosity_error()
    for case in CASES:
        train(sys.argv[1], case, int(sys.argv[2]))
