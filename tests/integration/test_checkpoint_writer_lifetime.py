"""A checkpoint save leaves no process behind. Megatron's checkpoint writer hands its results through a queue that it
would otherwise serve from a manager process started with "spawn" (one per trainer rank, which outlived a trainer
killed with SIGKILL); megatron_bridge's saves are synchronous and keep that queue in the trainer's process. Here a
real child process (one gloo rank, on the CPU) saves and reloads a sharded tensor with `dist_checkpointing` as the
policy does: after the save it has no child process, and the tensor comes back equal. Without
`checkpoint_results_in_process` the child has megatron's manager left running after the save, and this test fails."""
from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json, multiprocessing, os, sys
import torch, torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
import megatron_bridge.device as device
from megatron_bridge.policy import checkpoint_results_in_process

if __name__ == "__main__":
    work = sys.argv[1]
    device.install()
    dist.init_process_group("gloo", init_method=f"file://{work}/store", rank=0, world_size=1)
    checkpoint_results_in_process()
    os.makedirs(f"{work}/ckpt")
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}, f"{work}/ckpt")
    children = [p.pid for p in multiprocessing.active_children()]
    empty = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)}
    loaded = dist_checkpointing.load(empty, f"{work}/ckpt")
    print(json.dumps({"children": children, "queue": type(filesystem_async._results_queue).__module__,
                      "equal": bool(torch.equal(loaded["w"], weight))}), flush=True)
    dist.destroy_process_group()
"""


def test_a_checkpoint_save_leaves_no_process_behind(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(CHILD)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["children"] == [], f"processes still running after the save: {report['children']}"
    assert report["queue"] == "queue"  # in this process, not a multiprocessing manager's proxy
    assert report["equal"]
