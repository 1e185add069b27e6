"""An agent program as a user writes one, trained by rft's agent_program workflow (configs/smollm2-agent-program.yaml;
docs/data.md, "Training your own agent program"). Nothing in it knows rft: it reads a task, talks to an
OpenAI-compatible chat API with the official `openai` client (OPENAI_BASE_URL and OPENAI_API_KEY come from the
environment) and offers the model one tool, a calculator it runs itself; when the model answers without a tool call
(or after MAX_TURNS model turns) it prints its result line, `{"answer": "<the model's last reply>"}`, which the run's
reward scores against the task.

Run it by hand against any OpenAI-compatible server:
    echo '{"prompt": "What is 12 + 30?"}' | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x \
        python examples/agents/calculator_agent.py
"""
from __future__ import annotations

import ast
import json
import operator
import sys

import openai

MAX_TURNS = 3
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers, + - * /, parentheses), or `error: ...`."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")
    try:
        result = value(ast.parse(expression[:200], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


def main() -> None:
    task = json.load(sys.stdin)
    client = openai.OpenAI(max_retries=0)
    messages: list = [{"role": "system", "content": "Use the calculator tool, then reply with only the final number."},
                      {"role": "user", "content": task["prompt"]}]
    reply = ""
    for _ in range(MAX_TURNS):
        response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = response.choices[0].message
        reply = message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (ValueError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(expression)) if expression else "error: no expression"})
    print(json.dumps({"answer": reply}))


if __name__ == "__main__":
    main()
