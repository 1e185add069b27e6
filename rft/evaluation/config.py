"""The `eval` section: held-out task sets evaluated on published versions (`rft eval`, and during a run)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rft.config import COUNT, OPTIONAL, POSITIVE, PROBABILITY, SEED, Range, Section, SectionError, at_least, option
from rft.data.config import DataFormat


@dataclass(frozen=True)
class EvalSetConfig(Section):
    """One evaluation task set: where its rows come from, as in `data` (see rft/data/tasks.py)."""
    KEY = "eval.sets[]"
    name: str = option("",
        help="required: metrics are eval/<name>/accuracy, eval/<name>/pass@<k>, eval/<name>/mean@<k>")
    path: str = option("",
        help="as data.path: a file, an HF dataset directory (path:split), or a toy task for format generated")
    format: DataFormat = option("jsonl", help="as data.format")
    prompt_key: str = option("prompt", help="as data.prompt_key")
    answer_key: str = option("answer", help="as data.answer_key")
    prompt_template: str = option("{prompt}", help="as data.prompt_template")
    generated_tasks: int = option(100, help="format generated / reasoning_gym: how many tasks", range=COUNT)
    seed: int = option(1, range=SEED,
        help="format generated / reasoning_gym: generator seed (data.shuffle_seed seeds the training rows)")
    options: dict[str, Any] = option(factory=dict, help="reasoning_gym / generated: the dataset's options")
    reward: str = option("", help="registered name or package.module:function; empty: explorer.reward")


@dataclass(frozen=True)
class EvalConfig(Section):
    """Evaluation (`rft eval`, and every `every_steps` versions during a run): n samples per task with the
    explorer's engine and workflow; a sample is correct when its reward >= `correct_threshold`."""
    KEY = "eval"
    sets: list[EvalSetConfig] = option(factory=list, help="task sets: a list of mappings with the keys below")
    n_samples: int = option(8, help="samples per task", range=COUNT)
    k: int = option(4, help="pass@k and mean@k (unbiased estimates from n_samples samples); <= n_samples", range=COUNT)
    temperature: float = option(1.0, range=at_least(0, "0: greedy"),
        help="sampling temperature of evaluation (0: greedy), independent of explorer.temperature")
    top_p: float = option(1.0, range=Range(0, 1, low_open=True),
        help="nucleus sampling of evaluation, in (0, 1]; 1: off")
    max_tokens: int = option(0, help="0: explorer.max_tokens", range=at_least(0, "0: explorer.max_tokens"))
    correct_threshold: float = option(1.0, range=PROBABILITY,
        help="reward at or above which a sample counts as correct")
    every_steps: int = option(0, range=OPTIONAL,
        help="> 0: `rft run` also starts an evaluator on every every_steps-th published version")
    finish_timeout_s: float = option(600.0, range=POSITIVE,
        help="after the trainer finished, how long `rft run` waits for the final evaluation")

    def validate(self) -> None:
        if not 1 <= self.k <= self.n_samples:
            raise SectionError("k", f"must be in [1, eval.n_samples={self.n_samples}], got {self.k}")
        if self.every_steps and not self.sets:
            raise SectionError("sets", "eval.every_steps is set but there is no task set")
        seen: set[str] = set()
        for i, s in enumerate(self.sets):
            if re.fullmatch(r"[A-Za-z0-9._-]+", s.name) is None:
                raise SectionError(f"sets[{i}].name", f"required: letters, digits, '.', '_' or '-' (it names the "
                                  f"metrics); got {s.name!r}")
            if s.name in seen:
                raise SectionError(f"sets[{i}].name", f"{s.name!r} names two task sets")
            seen.add(s.name)
            if not s.path:
                raise SectionError(f"sets[{i}].path", "required: a dataset file or directory, or a toy task name")
