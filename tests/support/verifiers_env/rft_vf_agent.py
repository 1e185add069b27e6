"""The harness's agent program (rft_vf_arith.py): two chat turns through the official `openai` client."""
import sys

from openai import OpenAI

base_url, key, model, prompt = sys.argv[1:5]
client = OpenAI(base_url=base_url, api_key=key, max_retries=0)
messages = [{"role": "user", "content": prompt}]
for follow_up in ("Check it, then answer with the number only.", None):
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    if follow_up:
        messages.append({"role": "user", "content": follow_up})
