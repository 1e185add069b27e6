"""`rft bench micro-batches MODEL_DIR`: trainer steps on variable-length rows, fixed-shape vs token-budget
micro-batches.

One process (world size 1, gloo on CPU): a MegatronPolicy from MODEL_DIR trains `--steps` steps of `--rows` rows
(GRPO, token_mean) whose prompt and response lengths are drawn uniformly from `--prompt-len` and
`--response-len` (seeded; the same rows for every setting), once per setting: `--micro-batch-size` rows padded to
the step's longest row (`trainer.max_tokens_per_micro_batch: 0`, the default), and each budget of `--budgets`.
`--group-size G`: each run of G rows shares one prompt, as a GRPO group's samples do (default 1: every row its own);
`--share-prompts` adds the default setting again with the trainer's shared prompts (`trainer.share_prompts`,
megatron_bridge.shared_prompts: a prompt shared by rows of a micro-batch runs once), which the others run without.
Per setting it prints (and with `--json`, one JSON line of) the step's `padding_fraction`, and the median over
steps after the first (warm-up) of `train_s` (batching + forward/backward + optimizer step) and
`train_tokens_per_s` (real input tokens / train_s) — the numbers the trainer logs in metrics.jsonl. Loss per step is
printed too: the settings train the same rows at lr 1e-12 (the weights stay put), so their losses agree to float
rounding.

`--transformers` adds a reference row: the same rows trained by Hugging Face transformers' model of MODEL_DIR
(`AutoModelForCausalLM`, what TRL's GRPOTrainer trains) in the same process and threads, `--micro-batch-size` rows per
micro-batch padded to the longest, the output layer run from each micro-batch's first response prediction on (as the
trainer does, and TRL with `logits_to_keep`), the loss the advantage-weighted token mean of the response
log-probabilities, one AdamW step: the time the same work takes outside Megatron (`train_s`, median after the first).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from rft.algorithms import build_algorithm
from rft.algorithms.aggregation import with_kl_metric
from rft.algorithms.config import AlgorithmConfig
from rft.trainer.batch import plan_micro_batches


def _lengths(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    return int(low), int(high or low)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rft bench micro-batches", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompt-len", type=_lengths, default=(20, 60), help="LOW:HIGH tokens")
    parser.add_argument("--response-len", type=_lengths, default=(4, 200), help="LOW:HIGH tokens")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[1024])
    parser.add_argument("--group-size", type=int, default=1,
                        help="rows that share one prompt, as a GRPO group's samples do (default: %(default)s)")
    parser.add_argument("--share-prompts", action="store_true",
                        help="add the default setting with trainer.share_prompts (megatron_bridge.shared_prompts)")
    parser.add_argument("--transformers", action="store_true", help="add transformers' step on the same rows")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.group_size <= 8 or 8 % args.group_size:
        parser.error(f"--group-size must divide 8 (the rows of a group), got {args.group_size}")

    from megatron_bridge.policy import MegatronPolicy  # heavy: megatron.core
    from rft.ops.gpu_check_worker import step_rows  # heavy: torch; the rows gpu-check's shared-prompts row trains

    # Adam moves weights by ~lr: they stay put
    policy = MegatronPolicy(args.model_dir, lr=1e-12, seed=0, share_prompts=args.share_prompts)
    if args.share_prompts and not policy.share_prompts:
        parser.error(f"--share-prompts: not on this model here: {policy.describe()}")
    loss_fn = with_kl_metric(build_algorithm(AlgorithmConfig()).loss_fn)
    steps = [step_rows(np.random.default_rng(s), rows=args.rows, vocab=policy.vocab_size,
                       prompt_len=args.prompt_len, response_len=args.response_len, group_size=args.group_size)
             for s in range(args.steps)]
    settings = [(budget, False) for budget in dict.fromkeys([0, *args.budgets])]  # the default (0) once, each budget
    for budget, shared in settings + ([(0, True)] if args.share_prompts else []):
        policy.share_prompts = shared
        seconds, rates, fractions, losses = [], [], [], []
        for rows in steps:
            started = time.perf_counter()
            plan = plan_micro_batches(rows, dp_size=1, micro_batch_size=args.micro_batch_size,
                                      max_tokens_per_micro_batch=budget)
            metrics = policy.train_step(plan.for_rank(0), loss_fn)
            elapsed = time.perf_counter() - started
            seconds.append(elapsed)
            rates.append(plan.real_tokens / elapsed)
            fractions.append(plan.padding_fraction)
            losses.append(metrics["loss"])
        timed = slice(1, None) if len(steps) > 1 else slice(None)
        record = {"max_tokens_per_micro_batch": budget, "micro_batch_size": args.micro_batch_size,
                  "share_prompts": shared, "group_size": args.group_size,
                  "micro_batches": len(plan.ranks[0]), "padding_fraction": statistics.mean(fractions),
                  "train_s": statistics.median(seconds[timed]),
                  "train_tokens_per_s": statistics.median(rates[timed]), "loss": losses}
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"budget {budget or 'off':>6}{', prompts shared' if shared else ''}: "
                  f"padding {record['padding_fraction']:.3f}, "
                  f"{record['micro_batches']} micro-batches, train {record['train_s']:.2f} s/step, "
                  f"{record['train_tokens_per_s']:.0f} tokens/s, loss {', '.join(f'{x:.5f}' for x in losses)}",
                  flush=True)
    policy.close()
    if args.transformers:
        model, optimizer = transformers_model(args.model_dir)
        seconds = [transformers_step(model, optimizer, rows, args.micro_batch_size) for rows in steps]
        record = {"reference": "transformers", "micro_batch_size": args.micro_batch_size,
                  "train_s": statistics.median(seconds[timed])}
        print(json.dumps(record) if args.json else f"transformers: {record['train_s']:.2f} s/step", flush=True)
    return 0


def transformers_model(model_dir: str):
    """(model, AdamW at lr 1e-12): transformers' model of `model_dir` in float32, training mode."""
    import torch  # heavy: torch
    from transformers import AutoModelForCausalLM  # heavy: transformers

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-12)


def transformers_step(model, optimizer, rows, micro_batch_size: int) -> float:
    """Seconds for one step on `rows` (trainer.batch.Row): micro-batches of `micro_batch_size` rows right-padded to
    their longest, logits from the micro-batch's first response prediction on, loss -sum(advantage x response
    log-prob) / response tokens, backward per micro-batch, one optimizer step."""
    import torch  # heavy: torch

    started = time.perf_counter()
    tokens = sum(int(r.loss_mask.sum()) for r in rows)
    for first in range(0, len(rows), micro_batch_size):
        batch = rows[first:first + micro_batch_size]
        width = max(len(r.tokens) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        weights = torch.zeros(len(batch), width - 1)
        for i, r in enumerate(batch):
            ids[i, :len(r.tokens)] = torch.from_numpy(r.tokens.astype(np.int64))
            attention[i, :len(r.tokens)] = 1
            # the response token at position p is predicted from position p - 1
            weights[i, r.prompt_len - 1:len(r.tokens) - 1] = torch.from_numpy(r.loss_mask.astype(np.float32)) \
                * r.advantage
        start = min(r.prompt_len for r in batch) - 1  # the output layer runs from the first response prediction on
        logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=width - start).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, start + 1:, None]).squeeze(-1)
        (-(logp * weights[:, start:]).sum() / tokens).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - started
