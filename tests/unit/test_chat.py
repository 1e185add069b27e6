"""Chat prompts: prompts rendered exactly as `tokenizer.apply_chat_template` renders them (explorer workflows and SFT
demonstrations), generation stopping at the template's end-of-turn token (transformers engine), and the config error
for a model without a template. The tiny test model gets a ChatML template and its two special tokens here."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from rft.config import ConfigError
from rft.data.config import DataConfig
from rft.data.demonstrations import demonstration_groups, prompt_tools
from rft.data.tasks import DatasetError
from rft.engine import TransformersEngine
from rft.explorer.config import ExplorerConfig
from rft.models.config import ModelConfig
from rft.models.tiny import build_tokenizer, make_tiny_model
from rft.rewards import build_reward
from rft.run.config import config_from_dict
from rft.schema import TaskRecord
from rft.text.chat import TOOLS_FALLBACK, ChatPrompt, encode_chat, end_of_turn_id, stop_token_ids
from rft.workflows import WorkflowError, build_workflow, encode_prompt

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PROMPT = "What is 2 + 3?"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny model (untied output layer) with `<|im_start|>`, `<|im_end|>` and a ChatML template."""
    path = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-chat",
                           vocab_size=build_tokenizer().get_vocab_size() + 2, tie_word_embeddings=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    return path


def template_ids(tokenizer, messages) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def task(prompt=PROMPT, answer="5") -> TaskRecord:
    return TaskRecord(run_id="r", task_id="t", epoch=0, prompt=prompt, answer=answer)


def test_prompts_are_rendered_by_the_chat_template(chat_model):
    engine = TransformersEngine(chat_model, chat_template=True)
    tokenizer = engine.tokenizer
    with_system = encode_prompt(engine, task(), 256, ChatPrompt("Be brief."))
    assert with_system == template_ids(tokenizer, [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": PROMPT}])
    rendered = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{PROMPT}<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert encode_prompt(engine, task(), 256, ChatPrompt()) == template_ids(tokenizer, [{"role": "user",
                                                                                        "content": PROMPT}])
    assert encode_prompt(engine, task(), 256) == tokenizer(PROMPT)["input_ids"]  # chat off: plain text
    assert "over model.max_prompt_len=10" in encode_prompt(engine, task(), 10, ChatPrompt())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer) == im_end
    assert stop_token_ids(tokenizer) == sorted({tokenizer.eos_token_id, im_end})


def test_a_tokenizer_without_a_template_is_an_error(tiny_model):
    engine = TransformersEngine(tiny_model, chat_template=False)
    with pytest.raises(WorkflowError, match="model.chat_template: .*has no chat template"):
        encode_prompt(engine, task(), 256, ChatPrompt())
    assert end_of_turn_id(engine.tokenizer) == engine.tokenizer.eos_token_id


def model_that_says_end_of_turn_first(chat_model, out):
    """A copy of the chat model whose greedy first reply token to the chat prompt is `<|im_end|>` (its output row
    is made to outscore the token greedy would pick), and which would go on generating after it."""
    shutil.copytree(chat_model, out)
    engine = TransformersEngine(out)
    ids = template_ids(engine.tokenizer, [{"role": "user", "content": PROMPT}])
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids])).logits[0, -1]
    greedy, im_end = int(logits.argmax()), engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    state = load_file(out / "model.safetensors")
    scale = 2.0 if float(logits[greedy]) > 0 else 0.5
    state["lm_head.weight"][im_end] = state["lm_head.weight"][greedy] * scale
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out, im_end


def test_generation_stops_at_the_end_of_turn_token(chat_model, tmp_path):
    path, im_end = model_that_says_end_of_turn_first(chat_model, tmp_path / "eot")
    explorer = ExplorerConfig(engine="transformers", n_samples=2, temperature=0.0, max_tokens=6, reward="exact_match")
    for chat, expected_tokens, reason in ((True, 1, "stop"), (False, 6, "length")):
        model = ModelConfig(path=str(path), chat_template=chat, system_prompt="")
        engine = TransformersEngine.from_config(explorer, model, seed=0)
        workflow = build_workflow(explorer, model, build_reward(explorer))  # the explorers' and evaluation's path
        [result] = workflow.explore([task()], engine)
        assert result.error is None
        for sample in result.samples:
            assert sample.response_tokens.tolist()[0] == im_end
            assert len(sample.response_tokens) == expected_tokens and sample.finish_reason == reason, chat
            expected_prompt = (template_ids(engine.tokenizer, [{"role": "user", "content": PROMPT}]) if chat
                               else engine.tokenizer(PROMPT)["input_ids"])
            assert sample.prompt_tokens.tolist() == expected_prompt


def test_demonstrations_put_the_answer_in_the_assistant_turn(chat_model, tmp_path):
    rows = [{"prompt": PROMPT, "answer": "5"}, {"prompt": "What is 4 + 4?", "answer": 8}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(path=str(tmp_path / "d.jsonl"), selector="sequential")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = ModelConfig(path=str(chat_model), chat_template=True, system_prompt="Answer with a number.")
    groups = list(demonstration_groups(data, model, tokenizer, run_id="r"))
    for group, row in zip(groups, rows, strict=True):
        [sample] = group.samples
        assert sample.prompt_tokens.tolist() == template_ids(tokenizer, [
            {"role": "system", "content": "Answer with a number."}, {"role": "user", "content": row["prompt"]}])
        answer = tokenizer(str(row["answer"]), add_special_tokens=False)["input_ids"]
        assert sample.response_tokens.tolist() == answer + [im_end]  # the loss is on the answer and its end only
        assert sample.loss_mask.tolist() == [1] * (len(answer) + 1)
    plain = list(demonstration_groups(data, ModelConfig(path=str(chat_model)), tokenizer, run_id="r"))
    assert plain[0].samples[0].prompt_tokens.tolist() == tokenizer(PROMPT)["input_ids"]
    assert plain[0].samples[0].response_tokens.tolist()[-1] == tokenizer.eos_token_id


def test_conversation_demonstrations_are_laid_out_as_the_workflows_lay_out_episodes(chat_model, tmp_path):
    """A conversation answer (tools/make_demonstrations.py): prompt + response is the template's rendering of the
    whole conversation, the prompt shows the tool_agent's tools, and only the assistant turns (with their
    end-of-turn tokens) have loss mask 1; a malformed conversation is an error naming the row."""
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    rows = [{"prompt": "What is 3 + 4?", "answer": [{"role": "assistant", "content": call},
                                                   {"role": "tool", "name": "calculator", "content": "7"},
                                                   {"role": "assistant", "content": "7"}]},
            {"prompt": "Walk to G.", "answer": [{"role": "assistant", "content": "down"},
                                                {"role": "user", "content": "\ndown\nSF\nPG"},
                                                {"role": "assistant", "content": "right"}]}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(path=str(tmp_path / "d.jsonl"), selector="sequential")
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = ModelConfig(path=str(chat_model), chat_template=True, system_prompt="S.", max_response_len=200,
                        max_prompt_len=1000)
    tools = prompt_tools(ExplorerConfig(workflow="tool_agent", tools=["calculator"]))
    assert [t["function"]["name"] for t in tools] == ["calculator"]
    assert prompt_tools(ExplorerConfig()) == ()  # single_turn shows no tools
    groups = list(demonstration_groups(data, model, tokenizer, run_id="r", tools=tools))
    system = "S.\n\n" + TOOLS_FALLBACK.format(tools=json.dumps(tools[0]))  # CHATML ignores tools=
    for group, row in zip(groups, rows, strict=True):
        [sample] = group.samples
        assert sample.prompt_tokens.tolist() == encode_chat(tokenizer, row["prompt"], ChatPrompt("S.", tools))
        rendered = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                  {"role": "user", "content": row["prompt"]}, *row["answer"]],
                                                 tokenize=False)
        assert rendered.endswith("<|im_end|>\n")
        whole = tokenizer(rendered[:-1], add_special_tokens=False)["input_ids"]
        assert sample.prompt_tokens.tolist() + sample.response_tokens.tolist() == whole
        trained = [t for t, m in zip(sample.response_tokens.tolist(), sample.loss_mask.tolist(), strict=True) if m]
        assert trained == [t for turn in row["answer"] if turn["role"] == "assistant"
                           for t in tokenizer(turn["content"], add_special_tokens=False)["input_ids"] + [im_end]]
        assert sample.logprobs.tolist() == [0.0] * len(sample.response_tokens)
    for answer, match in [([{"role": "tool", "content": "7"}, {"role": "assistant", "content": "7"}],
                           "starts and ends with an assistant turn"),
                          ([{"role": "system", "content": "x"}], r"answer\[0\] must be"),
                          ([{"role": "assistant", "content": 7}], r"answer\[0\] must be")]:
        (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "p", "answer": answer}) + "\n")
        with pytest.raises(DatasetError, match=r"bad.jsonl row 0: .*" + match):
            list(demonstration_groups(DataConfig(path=str(tmp_path / "bad.jsonl")), model, tokenizer, run_id="r"))
    with pytest.raises(DatasetError, match="a conversation answer needs model.chat_template: true"):
        list(demonstration_groups(data, ModelConfig(path=str(chat_model), max_response_len=200), tokenizer,
                                  run_id="r"))


def test_chat_template_on_a_model_without_one_is_a_config_error(tiny_model, chat_model):
    with pytest.raises(ConfigError, match=r"<dict>: model.chat_template: the tokenizer in .* has no chat template"):
        config_from_dict({"model": {"path": str(tiny_model), "chat_template": True}})
    cfg = config_from_dict({"model": {"path": str(chat_model), "chat_template": True, "system_prompt": "Be brief."}})
    assert cfg.model.chat_template and cfg.model.system_prompt == "Be brief."
    config_from_dict({"model": {"path": str(tiny_model)}})  # off: no template needed
    config_from_dict({"model": {"path": "not/on/disk", "chat_template": True}})  # not checkable: no error


def test_multi_turn_observations_are_user_turns_of_the_template(chat_model, tmp_path):
    """With a chat template, an episode's tokens are exactly the template's rendering of the conversation: the
    prompt, each model turn as an assistant message, each observation as a user message, then the assistant header."""
    path, im_end = model_that_says_end_of_turn_first(chat_model, tmp_path / "eot")
    explorer = ExplorerConfig(engine="transformers", n_samples=2, temperature=0.0, max_tokens=6, reward="exact_match",
                              workflow="multi_turn", environment="tests.episodes:CountingEnvironment", max_turns=3)
    model = ModelConfig(path=str(path), chat_template=True, system_prompt="", max_response_len=200)
    engine = TransformersEngine.from_config(explorer, model, seed=0)
    [result] = build_workflow(explorer, model, build_reward(explorer)).explore([task()], engine)
    assert result.error is None and len(result.samples) == 2
    for s in result.samples:
        messages = [{"role": "user", "content": PROMPT}]
        for step in (1, 2):  # the model says only <|im_end|>; the environment answers "\nstep k\n"
            messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": f"\nstep {step}\n"}]
        full = template_ids(engine.tokenizer, messages) + [im_end]  # the third model turn, then the episode ends
        assert s.prompt_tokens.tolist() + s.response_tokens.tolist() == full
        assert s.loss_mask.tolist() == [1] + [0] * (len(s.loss_mask) // 2 - 1) + [1] + [0] * (
            len(s.loss_mask) // 2 - 1) + [1]
