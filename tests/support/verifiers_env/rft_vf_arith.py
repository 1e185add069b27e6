"""The tests' verifiers v1 environment (imported by verifiers, in its own venv, by its taskset id `rft_vf_arith`;
never by rft): two-turn arithmetic that runs offline.

Taskset: `size` additions "What is A + B?" with the sum as `answer`. Harness: rft_vf_agent.py, a program using the
official `openai` client, run by the subprocess runtime with the venv's python: it asks the question, then asks the
model to check its answer (two model calls). Rubric: two weighted rewards, `correct` (0.75: the reply holds the
sum) and `brief` (0.25: the last reply is under 40 characters). `fail` in the taskset config makes `correct` raise
(a verifier crash: verifiers' TaskError).
"""
import sys
from pathlib import Path

import verifiers.v1 as vf

PROGRAM = Path(__file__).with_name("rft_vf_agent.py")


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.75)
    async def correct(self, task, trace) -> float:
        if task.answer == "crash":
            raise RuntimeError("the verifier crashed")
        return 1.0 if task.answer in trace.last_reply else 0.0

    @vf.reward(weight=0.25)
    async def brief(self, trace) -> float:
        return 1.0 if len(trace.last_reply) < 40 else 0.0


class ArithConfig(vf.TasksetConfig):
    size: int = 4


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        for i in range(self.config.size):
            a, b = i + 2, 3 * i + 1
            yield ArithTask(ArithData(name=f"add-{i}", prompt=f"What is {a} + {b}?", answer=str(a + b)),
                            self.config.task)


class ArithHarnessConfig(vf.HarnessConfig):
    pass


class ArithHarness(vf.Harness[ArithHarnessConfig]):
    """Runs rft_vf_agent.py with this venv's python (no container, no network: the endpoint is local)."""
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        return await runtime.run([sys.executable, str(PROGRAM), endpoint, secret, ctx.model, data.prompt_text], {})


__all__ = ["ArithConfig", "ArithData", "ArithHarness", "ArithHarnessConfig", "ArithTask", "ArithTaskset"]
