"""Train a tiny GPT-2 with the transformers Trainer under adaptive_amp: one call before train().

Needs the ``integrations`` extra: ``pip install -e ".[integrations]"`` in the clone.

    python examples/hf_trainer_gpt2.py [--steps 20] [--policy auto] [--out DIR]

The model is built from a config (random weights, nothing downloaded) and
trains on random tokens; the point is the one line:

    adaptive_amp.integrations.transformers.attach(trainer, "auto")

Leave fp16/bf16 off in TrainingArguments: the policy decides the precision.
Checkpoints (save_steps) carry the controller's state in scaler.pt, and
``trainer.train(resume_from_checkpoint=...)`` resumes it.
"""

import argparse
import sys
import tempfile

try:
    import accelerate  # noqa: F401 (the Trainer trains through it, and so does adaptive_amp's adapter)
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
except ImportError as exc:  # one line naming what to install, not a traceback
    sys.exit(f"{__file__}: {exc.name} is missing; this example needs the integrations extra: "
             'pip install -e ".[integrations]"')

from adaptive_amp.integrations import transformers as adaptive_hf


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, length=64, vocab=256):
        self.rows = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--out", default=None, help="output directory (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="hf_trainer_gpt2_")

    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=8,
                                      learning_rate=1e-3, report_to=[], save_strategy="no", logging_steps=5,
                                      disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(8 * args.steps))
    callback = adaptive_hf.attach(trainer, args.policy, read_every=5)
    trainer.train()
    print(callback.amp.report(plots=False))


if __name__ == "__main__":
    main()
