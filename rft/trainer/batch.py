"""Experience groups -> micro-batches, per the batch contract (docs/architecture.md, "The batch contract").

Every data-parallel rank builds the same global list of rows from the same groups and takes its own slice, so the
normalisers (`global_tokens`, `global_sequences`) are known everywhere without communication; losses are sums over
rows divided by them, so any partition of the rows into micro-batches gives the same loss and gradients. By default
every micro-batch of a step is [micro_batch_size, T] (padding rows carry loss_mask 0: the pipeline schedule sends
fixed-shape activations between stages); with a token budget (`trainer.max_tokens_per_micro_batch`, pipeline_parallel
1) rows are grouped by length and each micro-batch is padded only to its own longest row (`plan_micro_batches`).
Preference pairs (`Needs(pairwise=True)`): a group is one pair (exactly 2 samples, different rewards; the higher
reward is chosen: `preference_pair_problem`), and a pair is the unit dealt to ranks and micro-batches, so both rows
of a pair are always in the same micro-batch. Every key a micro-batch carries is listed at `_pack`.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rft.algorithms.mismatch import STALENESS_BUCKETS, staleness_buckets
from rft.models.moe import MoEShape
from rft.schema import ExperienceGroup, RewardRange, RoutedExperts
from rft.trainer.images import ImagePrompts

# a micro-batch's image tensors from each row's processor output ({} for a text or padding row): the model family's
# `collate_images` (megatron_bridge.models.base.DecoderBridge; MegatronPolicy.collate_images)
CollateImages = Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]


@dataclass
class Row:
    tokens: np.ndarray  # prompt + response, int64
    prompt_len: int
    loss_mask: np.ndarray  # over response tokens
    old_logprobs: np.ndarray  # over response tokens
    advantage: float
    pair_index: int = -1  # preference pairs: the pair's number in the step (both rows); -1 outside pairs
    chosen: bool = False  # preference pairs: True for the preferred row
    demo: bool = False  # a demonstration row (algorithms with `needs.demonstrations`)
    # routing replay: [input positions, MoE layers, top_k] int32 expert ids, -1 where not recorded; None: no record
    routed: np.ndarray | None = None
    routed_layers: tuple[int, ...] = ()
    versions: np.ndarray | None = None  # the weights version of each response token (int64); None: unknown
    token_advantages: np.ndarray | None = None  # one per response token (float32; Needs.token_advantages); None: none
    # a vision-language prompt's image tensors as its processor gives them (rft.trainer.images), computed when the
    # row's micro-batch is packed (only the data-parallel rank that trains the row runs the processor); None: text
    pixels: Callable[[], dict[str, Any]] | None = None


@dataclass(frozen=True)
class TrainableLimits:
    """What a group must satisfy to be trained on (`problem`); the feed dead-letters one that does not, so a record
    that decodes but cannot be batched never crashes the trainer (nor, re-read from a checkpoint's offsets, again).
    `vocab_size`: the model's (config.json `vocab_size`); lengths in tokens (model.max_prompt_len / max_response_len,
    which every producer honours); `rewards`: run.reward_min .. reward_max (the group's `greedy_reward` too);
    `greedy_baseline`: the algorithm needs each group's `greedy_reward` (`Needs.greedy_baseline`); `moe`: with routing
    replay, the model's MoE layout, which every sample's `routed_experts` must match (`routing_problem`); `images`: a
    vision-language model's processor (rft.trainer.images), which must expand every sample's prompt and images to
    exactly its engine's prompt ids; None (a text model): a sample with images is refused."""
    vocab_size: int
    max_prompt_len: int
    max_response_len: int
    rewards: RewardRange
    greedy_baseline: bool = False
    moe: MoEShape | None = None
    images: ImagePrompts | None = None

    def problem(self, group: ExperienceGroup) -> str | None:
        """None when every sample of `group` can be trained on, else the first reason it cannot (names the sample)."""
        for position, s in enumerate(group.samples):
            problem = self._sample_problem(s)
            if problem:
                return f"samples[{position}]: {problem}"
        if self.greedy_baseline and group.greedy_reward is None:
            return ("no greedy_reward: the algorithm subtracts the reward of each task's greedy response, and this "
                    "group was explored without one (explorer.greedy_baseline)")
        return self.rewards.group_problem(group)

    def _sample_problem(self, s) -> str | None:
        prompt, response = s.prompt_tokens, s.response_tokens
        if len(prompt) == 0:
            return "empty prompt"
        if len(response) == 0:
            return "empty response"
        if len(prompt) > self.max_prompt_len:
            return f"prompt of {len(prompt)} tokens, over model.max_prompt_len={self.max_prompt_len}"
        if len(response) > self.max_response_len:
            return f"response of {len(response)} tokens, over model.max_response_len={self.max_response_len}"
        for name in ("logprobs", "loss_mask"):
            if len(getattr(s, name)) != len(response):
                return f"{name} has {len(getattr(s, name))} entries for {len(response)} response tokens"
        for name, ids in (("prompt", prompt), ("response", response)):
            if ids.min() < 0 or ids.max() >= self.vocab_size:
                bad = int(ids[(ids < 0) | (ids >= self.vocab_size)][0])
                return f"{name} token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        if self.moe is not None and s.routed_experts is not None and (problem := routing_problem(s.routed_experts,
                                                                                                 self.moe)):
            return problem
        if s.images and self.images is None:
            return (f"{len(s.images)} images, and the model (model.path) is not a vision-language model (its "
                    "config.json has no vision_config)")
        if self.images is not None and (problem := self.images.problem(s)):
            return f"images: {problem}"
        return None


def routing_problem(routed: RoutedExperts, moe: MoEShape) -> str | None:
    """None when `routed` (checked against itself by the schema) fits the model's MoE layout `moe`: its experts, its
    top-k and exactly its MoE layers, else what differs. A record that does not would fail the replay inside the
    step (megatron_bridge.routing_replay: a layer without a column, a top-k of another width, an expert id past the
    router's) on every rank, and again after every resume."""
    if routed.num_experts != moe.num_experts:
        return f"routed_experts over {routed.num_experts} experts, the model has {moe.num_experts}"
    if routed.ids.shape[2] != moe.top_k:
        return f"routed_experts of top-{routed.ids.shape[2]}, the model routes top-{moe.top_k}"
    if tuple(routed.layers) != moe.layers:
        return f"routed_experts of MoE layers {list(routed.layers)[:16]}, the model's are {list(moe.layers)[:16]}"
    return None


def preference_pair_problem(group: ExperienceGroup) -> str | None:
    """None when `group` encodes a preference pair (2 samples, different rewards), else the reason it does not, in
    the shape of the feed's skip reasons."""
    if len(group.samples) != 2:
        return "not_a_pair"
    if group.rewards[0] == group.rewards[1]:
        return "tied_pair"
    return None


def rows_from_groups(groups: list[ExperienceGroup], advantages: list[np.ndarray], *, max_len: int | None = None,
                     pairs: bool = False, routing: bool = False,
                     token_advantages: list[list[np.ndarray]] | None = None,
                     images: ImagePrompts | None = None) -> list[Row]:
    """One row per sample; `advantages[i][j]` belongs to sample j of group i, and so does `token_advantages[i][j]`
    (one per response token; ValueError naming the group when its length is not the response's). Sequences longer
    than `max_len` are cut at the end (the cut tokens leave the loss). With `pairs`, group i is preference pair i
    (ValueError naming the group when it is not one) and its rows are marked chosen / rejected. With `routing`
    (routing replay), rows keep their samples' recorded `routed_experts` (ValueError naming the group when two
    records of the step disagree on the MoE layers). A sample with images gets its row's `pixels` from `images` (the
    model's processor, run when the row is packed; ValueError naming the group without one, or when `max_len` would
    cut its prompt)."""
    rows: list[Row] = []
    per_token: list[list[np.ndarray | None]] = ([list(t) for t in token_advantages] if token_advantages is not None
                                                else [[None] * len(g.samples) for g in groups])
    for index, (group, group_adv, group_tokens) in enumerate(zip(groups, advantages, per_token, strict=True)):
        group_rows = [_row(sample, float(adv), max_len, routing, group.policy_version, tokens)
                      for sample, adv, tokens in zip(group.samples, group_adv, group_tokens, strict=True)]
        if any(t is not None and len(t) != len(s.response_tokens) for s, t in zip(group.samples, group_tokens,
                                                                                    strict=True)):
            raise ValueError(f"group {group.group_id}: token advantages not one per response token")
        if any(s.images for s in group.samples):
            _add_pixels(group_rows, group, images, max_len)
        if routing:
            _check_layers(rows + group_rows, group)
        if pairs:
            _mark_pair(group_rows, group, index)
        rows += group_rows
    return rows


def _row(sample, advantage: float, max_len: int | None, routing: bool = False, policy_version: int = 0,
         token_advantages: np.ndarray | None = None) -> Row:
    tokens = np.concatenate([sample.prompt_tokens, sample.response_tokens]).astype(np.int64)
    mask = sample.loss_mask.astype(np.float32)
    logprobs = sample.logprobs.astype(np.float32)
    versions = sample.versions_of(policy_version)
    per_token = None if token_advantages is None else np.asarray(token_advantages, dtype=np.float32)
    routed, layers = None, ()
    if routing and sample.routed_experts is not None:
        record = sample.routed_experts
        routed = np.full((len(tokens) - 1, *record.ids.shape[1:]), -1, dtype=np.int32)
        routed[record.first_position:] = record.ids  # the record covers input positions first_position..
        layers = tuple(record.layers)
    if max_len is not None and len(tokens) > max_len:
        keep = max(0, max_len - len(sample.prompt_tokens))
        tokens, mask, logprobs, versions = tokens[:max_len], mask[:keep], logprobs[:keep], versions[:keep]
        routed = routed[:max_len - 1] if routed is not None else None
        per_token = per_token[:keep] if per_token is not None else None
    return Row(tokens, len(sample.prompt_tokens), mask, logprobs, advantage, routed=routed, routed_layers=layers,
               versions=versions, token_advantages=per_token)


def _add_pixels(rows: list[Row], group: ExperienceGroup, images: ImagePrompts | None, max_len: int | None) -> None:
    """Each image sample's row gets its processor's pixels (rft.trainer.images; computed once per prompt, when
    packed)."""
    if images is None:
        raise ValueError(f"group {group.group_id}: samples with images, and the model has no image processor (not a "
                         "vision-language model)")
    for row, sample in zip(rows, group.samples, strict=True):
        if sample.images:
            if max_len is not None and len(sample.prompt_tokens) > max_len:
                raise ValueError(f"group {group.group_id}: a prompt of {len(sample.prompt_tokens)} tokens with images "
                                 f"would be cut at {max_len}, inside its image tokens")
            row.pixels = functools.partial(images.pixels, sample)


def replayed_fraction(rows: list[Row]) -> float:
    """Of the rows' loss tokens, the share whose forward pass has recorded routing (the input position before each
    token: what routing replay replays); 0.0 without loss tokens."""
    total = replayed = 0.0
    for row in rows:
        total += float(row.loss_mask.sum())
        if row.routed is not None:
            start = row.prompt_len - 1  # input position of the first response token's forward pass
            recorded = np.asarray((row.routed[start:start + len(row.loss_mask)] >= 0).all(axis=(1, 2)))
            replayed += float((row.loss_mask[:len(recorded)] * recorded).sum())
    return replayed / total if total else 0.0


def _check_layers(rows: list[Row], group: ExperienceGroup) -> None:
    layers = {r.routed_layers for r in rows if r.routed is not None}
    if len(layers) > 1:
        raise ValueError(f"group {group.group_id}: routed_experts of MoE layers {sorted(layers)} in one step: the "
                         f"records come from different models")


def _mark_pair(rows: list[Row], group: ExperienceGroup, index: int) -> None:
    problem = preference_pair_problem(group)
    if problem:
        raise ValueError(f"group {group.group_id}: {problem}, not a preference pair (a pair is a group of exactly "
                         f"2 samples with different rewards; rewards {group.rewards.tolist()})")
    chosen = int(np.argmax(group.rewards))
    for j, row in enumerate(rows):
        row.pair_index, row.chosen = index, j == chosen


@dataclass
class MicroBatchPlan:
    """Which rows go in which micro-batch of which data-parallel rank, and each micro-batch's padded shape.

    `ranks[d][i]` is micro-batch i of rank d: (rows, batch_size, seq_len), seq_len counting input positions
    (tokens - 1). Every rank has the same number of micro-batches. Built the same way on every rank from the same
    rows (`plan_micro_batches`), so `padding_fraction` and `real_tokens` are step-wide without communication."""
    ranks: list[list[tuple[list[Row], int, int]]]
    global_tokens: float
    global_sequences: float
    pairwise: bool
    global_demo_tokens: float = 0.0  # of global_tokens: on demonstration rows
    global_demo_sequences: float = 0.0
    trained_version: int | None = None  # the version the step starts from: micro-batches carry staleness buckets
    token_advantages: bool = False  # micro-batches carry `token_advantages` (some row has them: `_pack`)

    @property
    def real_tokens(self) -> int:
        """Input positions holding a real token, over all micro-batches of all ranks."""
        return sum(len(r.tokens) - 1 for rank in self.ranks for rows, _, _ in rank for r in rows)

    @property
    def token_slots(self) -> int:
        """Input positions computed (batch_size x seq_len summed over all micro-batches of all ranks)."""
        return sum(b * t for rank in self.ranks for _, b, t in rank)

    @property
    def padding_fraction(self) -> float:
        """Padded slots / all slots over the step's micro-batches (padding rows included)."""
        return 1.0 - self.real_tokens / max(self.token_slots, 1)

    def for_rank(self, dp_rank: int, *, pad_id: int = 0,
                 collate_images: CollateImages | None = None) -> list[dict[str, torch.Tensor]]:
        """Rank `dp_rank`'s micro-batches as tensors (the batch contract); a micro-batch with image rows gets the
        image tensors `collate_images` (the model family's) makes of them (ValueError without it)."""
        demo_totals = {"global_demo_tokens": torch.tensor(self.global_demo_tokens),
                       "global_demo_sequences": torch.tensor(self.global_demo_sequences)}
        if self.trained_version is not None:
            demo_totals["staleness_tokens"] = torch.from_numpy(self.staleness_tokens())
        return [{**_pack(rows, batch_size, seq_len, pad_id, self.global_tokens, self.global_sequences,
                         pairwise=self.pairwise, trained_version=self.trained_version,
                         token_advantages=self.token_advantages, collate_images=collate_images), **demo_totals}
                for rows, batch_size, seq_len in self.ranks[dp_rank]]

    def staleness_tokens(self) -> np.ndarray:
        """[STALENESS_BUCKETS] float64: the loss tokens of policy rows in each staleness bucket, over the whole
        step (every rank's rows); zeros without a `trained_version`."""
        counts = np.zeros(STALENESS_BUCKETS, dtype=np.float64)
        if self.trained_version is None:
            return counts
        for rank in self.ranks:
            for rows, _, _ in rank:
                for row in rows:
                    buckets = _row_buckets(row, self.trained_version)
                    np.add.at(counts, buckets[buckets >= 0], row.loss_mask[buckets >= 0])
        return counts


def plan_micro_batches(rows: list[Row], *, dp_size: int, micro_batch_size: int,
                       max_tokens_per_micro_batch: int = 0, trained_version: int | None = None) -> MicroBatchPlan:
    """Deal the step's rows (preference pairs, when the rows are pairs) into micro-batches over data-parallel ranks.

    `max_tokens_per_micro_batch` 0 (fixed shape, what pipeline parallelism needs): rows are dealt round-robin over
    ranks, then `micro_batch_size` at a time; every micro-batch is [micro_batch_size, T], T the step's longest row.
    > 0 (token budget, pipeline_parallel 1): rows are sorted by length (longest first, ties in step order) and
    packed greedily into micro-batches with rows x T_i <= budget, T_i the micro-batch's own longest row (a single
    row or pair longer than the budget gets a micro-batch of its own); `micro_batch_size` is not used. Micro-batches
    are dealt to ranks longest-work first, each to the rank with the fewest token slots among those holding fewer
    than ceil(n / dp_size); ranks left short get empty micro-batches ([1, 1], loss_mask 0). `trained_version`: the
    version the step starts from; micro-batches then carry the staleness buckets (module docstring)."""
    units = _units(rows)
    pairwise = rows[0].pair_index >= 0
    global_tokens = float(sum(r.loss_mask.sum() for r in rows))
    if max_tokens_per_micro_batch:
        ranks = _budget_plan(units, dp_size, max_tokens_per_micro_batch)
    else:
        ranks = _fixed_plan(units, dp_size, micro_batch_size, pairwise)
    return MicroBatchPlan(ranks, global_tokens, float(len(rows)), pairwise,
                          global_demo_tokens=float(sum(r.loss_mask.sum() for r in rows if r.demo)),
                          global_demo_sequences=float(sum(r.demo for r in rows)), trained_version=trained_version,
                          token_advantages=any(r.token_advantages is not None for r in rows))


def micro_batches_for_rank(rows: list[Row], *, dp_rank: int, dp_size: int, micro_batch_size: int,
                           max_tokens_per_micro_batch: int = 0, pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of `plan_micro_batches(rows, ...)`."""
    return plan_micro_batches(rows, dp_size=dp_size, micro_batch_size=micro_batch_size,
                              max_tokens_per_micro_batch=max_tokens_per_micro_batch).for_rank(dp_rank, pad_id=pad_id)


def _fixed_plan(units: list[list[Row]], dp_size: int, micro_batch_size: int, pairwise: bool):
    rows_per_unit = 2 if pairwise else 1
    if micro_batch_size % rows_per_unit:
        raise ValueError(f"trainer.micro_batch_size must be even for preference pairs (both rows of a pair go in "
                         f"one micro-batch), got {micro_batch_size}")
    units_per_micro = micro_batch_size // rows_per_unit
    seq_len = max(_unit_len(u) for u in units)
    per_rank = -(-len(units) // dp_size)
    n_micro = max(1, -(-per_rank // units_per_micro))
    plan = []
    for dp_rank in range(dp_size):
        mine = units[dp_rank::dp_size]
        plan.append([([row for unit in mine[i * units_per_micro:(i + 1) * units_per_micro] for row in unit],
                      micro_batch_size, seq_len) for i in range(n_micro)])
    return plan


def _budget_plan(units: list[list[Row]], dp_size: int, budget: int):
    batches: list[list[Row]] = []
    for unit in sorted(units, key=_unit_len, reverse=True):  # stable: equal lengths keep step order
        if batches and (len(batches[-1]) + len(unit)) * (len(batches[-1][0].tokens) - 1) <= budget:
            batches[-1] += unit  # the first row of a micro-batch is its longest (descending order)
        else:
            batches.append(list(unit))
    shaped = [(rows, len(rows), max(len(r.tokens) for r in rows) - 1) for rows in batches]
    per_rank = -(-len(shaped) // dp_size)
    plan: list[list] = [[] for _ in range(dp_size)]
    slots = [0] * dp_size
    for micro in sorted(shaped, key=lambda m: m[1] * m[2], reverse=True):
        rank = min((d for d in range(dp_size) if len(plan[d]) < per_rank), key=lambda d: slots[d])
        plan[rank].append(micro)
        slots[rank] += micro[1] * micro[2]
    for micros in plan:
        micros += [([], 1, 1)] * (per_rank - len(micros))
    return plan


def _unit_len(unit: list[Row]) -> int:
    """Input positions of a unit's longest row."""
    return max(len(r.tokens) for r in unit) - 1


def _units(rows: list[Row]) -> list[list[Row]]:
    """What is dealt and packed whole: single rows, or the two rows of each preference pair (adjacent)."""
    if not rows:
        raise ValueError("no rows to build micro-batches from")
    if rows[0].pair_index < 0:
        if any(r.pair_index >= 0 for r in rows):
            raise ValueError("rows mix preference pairs and single rows")
        return [[r] for r in rows]
    units = [rows[i:i + 2] for i in range(0, len(rows), 2)]
    for unit in units:
        if len(unit) != 2 or unit[0].pair_index != unit[1].pair_index or unit[0].chosen == unit[1].chosen:
            raise ValueError(f"preference pair {unit[0].pair_index}: needs its 2 rows adjacent, one chosen")
    return units


def _row_buckets(row: Row, trained_version: int) -> np.ndarray:
    """The staleness bucket of each of the row's response tokens: -1 for a demonstration row, a row without versions
    and a token outside the loss (rft.algorithms.mismatch.staleness_buckets otherwise)."""
    if row.demo or row.versions is None:
        return np.full(len(row.loss_mask), -1, dtype=np.int64)
    return np.where(row.loss_mask > 0, staleness_buckets(trained_version - row.versions), -1)


def _pack(rows: list[Row], batch_size: int, seq_len: int, pad_id: int, global_tokens: float,
          global_sequences: float, *, pairwise: bool, trained_version: int | None = None,
          token_advantages: bool = False, collate_images: CollateImages | None = None) -> dict[str, torch.Tensor]:
    """One micro-batch of `rows` as tensors [batch_size, seq_len] (padding rows past the rows): the tokens, targets,
    positions, `loss_mask`, `old_logprobs`, `advantages`, the step's normalisers, and
    - `row_lens` [b] (input positions of each row, 0 for padding rows), read by sequence packing
      (megatron_bridge.packing), and `prompt_lens` [b] (each row's prompt tokens), read by shared prompts and by a
      vision-language model (image placeholders only before it: megatron_bridge.vision);
    - `demo_mask` [b] (1.0 on demonstration rows, `Row.demo`); the trainer adds the step's `global_demo_tokens` /
      `global_demo_sequences` (0 without demonstrations), so a loss normalises demonstrations and policy rows apart;
    - with `pairwise`: `pair_index` (the pair's number in the step, -1 on padding rows) and `pair_chosen`;
    - routing replay (`rows_from_groups(routing=True)`), when any row recorded its MoE routing: `routed_experts`
      [b, T, layers, top_k] int32 (-1 where not recorded: other rows, padding, prompt positions before the record's
      first one) and `routed_layers` [layers] (the MoE layers' decoder indices), replayed by
      megatron_bridge.routing_replay;
    - staleness per token (`trained_version` v = step - 1, the version the step starts from): `staleness_bucket`
      [b, T] int64 (rft.algorithms.mismatch's bucket of v - the version of each loss token of a policy row, from
      `Row.versions`: the sample's `token_versions`, else its group's `policy_version`; -1 elsewhere); the trainer
      adds the step's `staleness_tokens` [STALENESS_BUCKETS] float64 (`MicroBatchPlan.staleness_tokens`), by which
      the training-inference mismatch is split;
    - with `token_advantages` (some row of the step has `Row.token_advantages`): `token_advantages` [b, T] float32,
      each response token's advantage at its target index (a row without them: its `advantage` on every response
      token; 0 elsewhere);
    - when some row has images (`Row.pixels`): the model family's image tensors, `collate_images` of every row's
      pixels in row order ({} for text rows and padding rows), e.g. Idefics3's `pixel_values` [b, images, 3, H, W]."""
    input_ids = np.full((batch_size, seq_len), pad_id, dtype=np.int64)
    target_ids = np.full((batch_size, seq_len), pad_id, dtype=np.int64)
    loss_mask = np.zeros((batch_size, seq_len), dtype=np.float32)
    old_logprobs = np.zeros((batch_size, seq_len), dtype=np.float32)
    advantages = np.zeros(batch_size, dtype=np.float32)
    pair_index = np.full(batch_size, -1, dtype=np.int64)
    pair_chosen = np.zeros(batch_size, dtype=bool)
    row_lens = np.zeros(batch_size, dtype=np.int64)
    prompt_lens = np.zeros(batch_size, dtype=np.int64)
    demo_mask = np.zeros(batch_size, dtype=np.float32)
    buckets = np.full((batch_size, seq_len), -1, dtype=np.int64)
    per_token = np.zeros((batch_size, seq_len), dtype=np.float32)
    for i, row in enumerate(rows):
        n = len(row.tokens) - 1
        row_lens[i], prompt_lens[i] = n, min(row.prompt_len, n)
        input_ids[i, :n], target_ids[i, :n] = row.tokens[:-1], row.tokens[1:]
        start = row.prompt_len - 1  # target index of the first response token
        r = len(row.loss_mask)
        loss_mask[i, start:start + r] = row.loss_mask
        old_logprobs[i, start:start + r] = row.old_logprobs
        if trained_version is not None:
            buckets[i, start:start + r] = _row_buckets(row, trained_version)
        advantages[i] = row.advantage
        per_token[i, start:start + r] = row.token_advantages if row.token_advantages is not None else row.advantage
        pair_index[i], pair_chosen[i], demo_mask[i] = row.pair_index, row.chosen, row.demo
    pairs = {"pair_index": torch.from_numpy(pair_index), "pair_chosen": torch.from_numpy(pair_chosen)}
    routing = {}
    first = next((row for row in rows if row.routed is not None), None)
    if first is not None and first.routed is not None:
        ids = np.full((batch_size, seq_len, *first.routed.shape[1:]), -1, dtype=np.int32)
        for i, row in enumerate(rows):
            if row.routed is not None:
                ids[i, :len(row.routed)] = row.routed
        routing = {"routed_experts": torch.from_numpy(ids),
                   "routed_layers": torch.tensor(first.routed_layers, dtype=torch.int64)}
    images = {}
    if any(row.pixels is not None for row in rows):
        if collate_images is None:
            raise ValueError("rows with images: a micro-batch needs the model's collate_images")
        images = collate_images([row.pixels() if row.pixels is not None else {} for row in rows]
                                + [{}] * (batch_size - len(rows)))
    return {
        "input_ids": torch.from_numpy(input_ids), "target_ids": torch.from_numpy(target_ids),
        "position_ids": torch.arange(seq_len, dtype=torch.int64).expand(batch_size, seq_len).contiguous(),
        "loss_mask": torch.from_numpy(loss_mask), "old_logprobs": torch.from_numpy(old_logprobs),
        "advantages": torch.from_numpy(advantages), "row_lens": torch.from_numpy(row_lens),
        "prompt_lens": torch.from_numpy(prompt_lens),
        "demo_mask": torch.from_numpy(demo_mask),
        "global_tokens": torch.tensor(global_tokens), "global_sequences": torch.tensor(global_sequences),
        **(pairs if pairwise else {}), **routing,
        **({"staleness_bucket": torch.from_numpy(buckets)} if trained_version is not None else {}),
        **({"token_advantages": torch.from_numpy(per_token)} if token_advantages else {}), **images,
    }
