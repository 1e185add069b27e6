"""The Slurm launchers on a real Slurm (tests/slurm/cluster.py: two nodes on this machine) against the real local
broker: `rft publish`, then an explorer fleet as a job array (launch/slurm/explorers.sbatch) and the trainer as a
two-node job (launch/slurm/trainer.sbatch: one process per node, data parallel 2, rendezvous across the nodes).
The trainer job must end with exit 0 after max_steps steps on groups made by the explorers Slurm started; `scancel`
of the array makes those explorers leave the run cleanly. Kafka's address reaches both jobs only through
RFT_KAFKA_BOOTSTRAP (the config says `embedded`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rft.run.config import load_config
from tests.integration.explorer_support import REPO, Control, Experiences, subprocess_env
from tests.slurm.cluster import FINAL_STATES

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.vllm, pytest.mark.distributed]

STEPS = 3
GROUPS_PER_STEP = 4
EXPLORERS = 2
TRAINER_NODES = 2  # one trainer process per node: trainer.data_parallel = 2
JOB_MINUTES = 5
TRAINER_TIMEOUT_S = 300
COMMON_OPTIONS = ["--export=ALL", f"--time={JOB_MINUTES}", "--cpus-per-task=1"]  # over the scripts' #SBATCH defaults


def write_config(path: Path, *, run: str, model: Path, output_dir: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "run": {"name": run, "mode": "async", "max_steps": STEPS, "output_dir": str(output_dir),
                "groups_per_step": GROUPS_PER_STEP},
        "model": {"path": str(model), "max_prompt_len": 8, "max_response_len": 1},
        "kafka": {"bootstrap_servers": "embedded", "partitions": EXPLORERS},
        "explorer": {"n_samples": 4, "max_tokens": 1, "tasks_per_batch": 2, "reward": "char_accuracy",
                     "heartbeat_s": 1.0, "cpu_kvcache_gb": 0.1, "gpu_memory_utilization": 0.1},
        "trainer": {"micro_batch_size": 8, "lr": 3e-3, "checkpoint_every": 100, "data_parallel": TRAINER_NODES},
        "data": {"format": "generated", "path": "copy_char", "generated_tasks": 64},
        "monitor": {"progress": False},
    }))
    return path


def job_outputs(directory: Path) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text(errors='replace')[-6000:]}"
                     for p in sorted(directory.glob("*.out")))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def job_env(bootstrap: str, **extra: str) -> dict[str, str]:
    return dict(subprocess_env(), RFT_KAFKA_BOOTSTRAP=bootstrap, RFT_PYTHON=sys.executable, **extra)


def test_trainer_and_explorer_array_under_slurm(slurm, broker, tiny_model, tmp_path, topic_prefix):
    bootstrap = broker.bootstrap_servers
    config = write_config(tmp_path / "run.yaml", run=topic_prefix, model=tiny_model, output_dir=tmp_path / "runs")
    published = subprocess.run([sys.executable, "-m", "rft.cli", "publish", str(config),
                                "--set", f"kafka.bootstrap_servers={bootstrap}"],
                               cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert published.returncode == 0, published.stderr
    cfg = load_config(config, [f"kafka.bootstrap_servers={bootstrap}"])
    experiences, control = Experiences(cfg, cfg.topic("experiences")), Control(cfg, cfg.topic("control"))

    env = job_env(bootstrap)
    outputs = tmp_path / "jobs"
    outputs.mkdir()
    explorers = slurm.sbatch(REPO / "launch/slurm/explorers.sbatch", str(config), cwd=REPO, env=env,
                             options=[*COMMON_OPTIONS, f"--array=0-{EXPLORERS - 1}",
                                      f"--output={outputs}/%x-%A_%a.out"])
    trainer = slurm.sbatch(REPO / "launch/slurm/trainer.sbatch", str(config), cwd=REPO, env=env,
                           options=[*COMMON_OPTIONS, f"--nodes={TRAINER_NODES}", f"--output={outputs}/%x-%j.out"])
    try:
        [job] = slurm.wait_for(trainer, FINAL_STATES, TRAINER_TIMEOUT_S)
        assert (job["JobState"], job["ExitCode"], job["NumNodes"]) == ("COMPLETED", "0:0", str(TRAINER_NODES)), job
        run_dir = tmp_path / "runs" / topic_prefix
        assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
        consumed = read_jsonl(run_dir / "consumed.jsonl")
        assert len(consumed) == STEPS * GROUPS_PER_STEP

        # every consumed group came from an explorer of the array (ids slurm-<array job>_<index>-<task>)
        fleet = {f"slurm-{explorers}_{i}-0" for i in range(EXPLORERS)}
        experiences.wait_for(lambda: {g.group_id for g in experiences.groups} >= {c["group_id"] for c in consumed},
                             timeout_s=30, what="the consumed groups on the experiences topic")
        made_by = {g.group_id: g.explorer_id for g in experiences.groups}
        assert {made_by[c["group_id"]] for c in consumed} <= fleet
        control.wait_for(lambda: {m.sender for m in control.messages("explorer_join")} >= fleet, timeout_s=30,
                         what="every array task's explorer to join")

        # scaling down: scancel the array, its explorers finish their batch and leave
        slurm.scancel(explorers)
        control.wait_for(lambda: {m.sender for m in control.messages("explorer_leave")} >= fleet, timeout_s=30,
                         what="every explorer to leave after scancel")
        assert {m.body["reason"] for m in control.messages("explorer_leave")} == {"stopped"}
        slurm.wait_for(explorers, {"CANCELLED"}, 60)
    except Exception as e:
        raise AssertionError(f"{e}\n\nSlurm job outputs:\n{job_outputs(outputs)}\n\n{slurm.logs(15)}") from e
    finally:
        experiences.close()
        control.close()


def test_trainer_job_refuses_more_processes_than_the_config_asks_for(slurm, tiny_model, tmp_path):
    """RFT_GPUS_PER_NODE=2 on two nodes, but TP x PP x DP = 2: the job fails before torchrun starts, saying why."""
    config = write_config(tmp_path / "run.yaml", run="misfit", model=tiny_model, output_dir=tmp_path / "runs")
    output = tmp_path / "trainer.out"
    job = slurm.sbatch(REPO / "launch/slurm/trainer.sbatch", str(config), cwd=REPO,
                       env=job_env("127.0.0.1:9", RFT_GPUS_PER_NODE="2"),
                       options=[*COMMON_OPTIONS, f"--nodes={TRAINER_NODES}", f"--output={output}"])
    [state] = slurm.wait_for(job, FINAL_STATES, 120)
    text = output.read_text()
    assert state["JobState"] == "FAILED", text  # exit code 2 from the first node; the other may be terminated
    assert "2 node(s) x 2 processes per node = 4, but the config's trainer world size (tensor x pipeline x data " \
           "parallel) is 2" in text, text
    assert "torch.distributed" not in text and not (tmp_path / "runs").exists(), text
