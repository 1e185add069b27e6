"""Workflows on a real (tiny, HF transformers) engine: group shapes, behaviour log-probs checked against an
independent forward pass, rewards, version stamping, environment-token masking, bad tasks, registry."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rft.config import ConfigError
from rft.engine import SamplingSettings, TransformersEngine
from rft.rewards import build_reward, resolve
from rft.run.loading import run_config_from_dict
from rft.schema import TaskRecord
from rft.workflows import available_workflows, build_workflow

ALPHABET = "0123456789"


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TransformersEngine(tiny_model, seed=0, weights_version=3)


def make_cfg(tiny_model, max_response_len: int = 48, **explorer):
    return run_config_from_dict({"model": {"path": str(tiny_model), "max_response_len": max_response_len},
                             "explorer": {"engine": "transformers", "reward": "char_accuracy", **explorer}})


def toy_tasks(n: int) -> list[TaskRecord]:
    return [TaskRecord("r", f"t{i}", 0, f":{ALPHABET[i % 10]}", ALPHABET[i % 10], {"alphabet": ALPHABET})
            for i in range(n)]


def reference_logprobs(model, prompt, response, *, temperature: float) -> np.ndarray:
    """log softmax(logits / T) of each response token, from one forward pass over prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()


def test_single_turn_groups(tiny_model, engine):
    cfg = make_cfg(tiny_model, n_samples=4, max_tokens=6, temperature=0.7)
    tasks = toy_tasks(3)
    results = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore(tasks, engine)
    assert [r.task for r in results] == tasks
    char_accuracy = resolve("char_accuracy")[1]
    for result in results:
        assert result.error is None and result.policy_version == 3
        assert [s.sample_index for s in result.samples] == [0, 1, 2, 3]
        for s in result.samples:
            n = len(s.response_tokens)
            assert 1 <= n <= 6 and s.logprobs.shape == (n,) and s.loss_mask.tolist() == [1] * n
            assert engine.decode(s.prompt_tokens) == result.task.prompt
            expected = char_accuracy(engine.decode(s.response_tokens), result.task)
            assert s.reward == pytest.approx(expected.score)
            # behaviour log-probs are those of the sampling distribution (temperature 0.7)
            ref = reference_logprobs(engine.model, s.prompt_tokens, s.response_tokens, temperature=0.7)
            np.testing.assert_allclose(s.logprobs, ref, atol=1e-4)


def test_too_long_prompt_is_an_error_not_a_crash(tiny_model, engine):
    cfg = make_cfg(tiny_model, n_samples=2, max_tokens=2)
    long_task = TaskRecord("r", "long", 0, "9" * 300, "9")
    workflow = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))
    results = workflow.explore([long_task] + toy_tasks(1), engine)
    assert results[0].error == "prompt is 300 tokens, over model.max_prompt_len=256" and not results[0].samples
    assert results[1].error is None and len(results[1].samples) == 2


def test_multi_turn_masks_environment_tokens(tiny_model, engine):
    cfg = make_cfg(tiny_model, workflow="multi_turn", environment="retry", max_turns=3, n_samples=3, max_tokens=5,
                   max_response_len=128)
    reward = build_reward(cfg.explorer)
    [result] = build_workflow(cfg.explorer, cfg.model, reward).explore(toy_tasks(1), engine)
    task = result.task
    for s in result.samples:
        mask = s.loss_mask.tolist()
        turns = s.metadata["turns"]
        segments = _runs(mask)
        # model, environment, model, ... alternate, starting and ending with the model
        assert [value for value, _ in segments] == [1, 0] * (turns - 1) + [1]
        position = last_model_start = 0  # the segments start with the model's turn
        for value, length in segments:
            tokens = s.response_tokens[position:position + length]
            if value == 0:
                previous_turn = engine.decode(s.response_tokens[last_model_start:position])
                score = reward.score([previous_turn], task)[0].score
                assert engine.decode(tokens) == engine.decode(engine.encode(
                    f"\nscore {score:.2f}, try again:\n", add_special_tokens=False))
                assert np.all(s.logprobs[position:position + length] == 0.0)
            else:
                last_model_start = position
                assert np.all(s.logprobs[position:position + length] < 0.0)
            position += length
        last_turn = engine.decode(s.response_tokens[last_model_start:])
        assert s.reward == pytest.approx(reward.score([last_turn], task)[0].score)
        assert s.reward_components["turns"] == turns and (turns == 3 or s.reward == 1.0)
    assert result.policy_version == 3


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for m in mask:
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1] + 1)
        else:
            runs.append((m, 1))
    return runs


def test_transformers_engine_reload_changes_weights_and_version(tiny_model, tmp_path):
    from rft.weights.store import WeightStore

    engine = TransformersEngine(tiny_model, seed=0)
    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=8)
    prompt = engine.encode(":5")
    before = engine.generate([prompt], greedy)[0].completions[0].token_ids
    perturbed = {k: v + 0.5 * torch.randn_like(v) for k, v in engine.model.state_dict().items()
                 if k != "lm_head.weight"}
    path = WeightStore(tmp_path).publish(1, [perturbed], tiny_model)
    engine.load_weights(path, 1)
    after = engine.generate([prompt], greedy)[0].completions[0]
    assert engine.weights_version == 1 and after.weights_version == 1
    assert after.token_ids != before


def test_workflow_registry_and_config_errors(tiny_model):
    assert {"single_turn", "multi_turn"} <= set(available_workflows())
    with pytest.raises(ConfigError, match="explorer.workflow: unknown workflow 'single' \\(did you mean 'single_turn'"):
        make_cfg(tiny_model, workflow="single")
    with pytest.raises(ConfigError, match="explorer.environment: unknown environment 'retyr'"):
        make_cfg(tiny_model, workflow="multi_turn", environment="retyr")
    with pytest.raises(ConfigError, match=r"explorer.continuous: workflow multi_turn has no streaming interface .* "
                                          r"supports single-turn workflows \(single_turn\)"):
        make_cfg(tiny_model, engine="vllm", workflow="multi_turn", continuous=True)
    assert make_cfg(tiny_model, engine="vllm", continuous=True).explorer.continuous
    cfg = make_cfg(tiny_model, workflow="rft.workflows.single_turn:SingleTurn")
    assert type(build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer))).__name__ == "SingleTurn"


def test_multi_turn_stops_at_the_response_budget(tiny_model, engine):
    cfg = make_cfg(tiny_model, workflow="multi_turn", max_turns=5, n_samples=2, max_tokens=5, max_response_len=30)
    [result] = build_workflow(cfg.explorer, cfg.model, build_reward(cfg.explorer)).explore(toy_tasks(1), engine)
    for s in result.samples:
        assert len(s.response_tokens) <= 30 and s.loss_mask[-1] == 1  # never ends on environment tokens
        assert s.metadata["turns"] < 5
