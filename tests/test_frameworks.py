"""Frameworks written for torchrun, run unchanged in `%%distributed` cells on a real 2-rank gloo
cluster: Lightning (Trainer and Fabric), accelerate, the HF Trainer and plain DDP. Each trains, the
ranks end with the weights a one-process replay of what they saw gives, and nbtrain's group still
works in the next cell. The engines carry torchrun's whole environment, checked against what torchrun
itself sets, and keep it through a re-init and a replaced engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from nbtrain.errors import DistributedCellError
from tests.conftest import magic_cluster, run_cell, wait_gone

pytestmark = pytest.mark.timeout(300)

# the variables torchrun's agent sets for itself or for its own error files, not for the program
AGENT_ONLY = {"TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_ERROR_FILE"}
LR = 0.1


@pytest.fixture(scope="module")
def cluster(ip):
    """One 2-rank gloo cluster for the module, started and stopped with the magics."""
    with magic_cluster(ip, 2) as c:
        run_cell(ip, "import torch, torch.distributed as dist\ntorch.set_num_threads(1)")
        yield c


# --------------------------------------------------------------------------- shared cell code
# every rank starts from its own random weights (DDP, Fabric and accelerate broadcast rank 0's) and
# records the batches it trained on, so the test can replay the run in one process
DATA = (
    "import torch\n"
    "from torch import nn\n"
    "g = torch.Generator().manual_seed(0)\n"
    "X = torch.randn(64, 4, generator=g)\n"
    "Y = X @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])\n"
    "data = torch.utils.data.TensorDataset(X, Y)\n"
    "seen = []\n"
    "torch.manual_seed(rank)\n"
    "net = nn.Linear(4, 1)\n"
    "w_init = [p.detach().clone() for p in net.parameters()]\n"
)

LIGHTNING_FIT = (
    DATA + "import lightning as L\n"
    "class Model(L.LightningModule):\n"
    "    def __init__(self, net):\n"
    "        super().__init__()\n"
    "        self.net = net\n"
    "    def training_step(self, batch, i):\n"
    "        x, y = batch\n"
    "        seen.append(x.clone())\n"
    "        return nn.functional.mse_loss(self.net(x), y)\n"
    "    def configure_optimizers(self):\n"
    f"        return torch.optim.SGD(self.parameters(), lr={LR})\n"
    "trainer = L.Trainer(strategy='ddp', accelerator='cpu', devices=DEVICES, num_nodes=NODES,\n"
    "                    max_epochs=2, logger=False, enable_checkpointing=False,\n"
    "                    enable_progress_bar=False, enable_model_summary=False)\n"
    "trainer.fit(Model(net), torch.utils.data.DataLoader(data, batch_size=8))\n"
    "w_end = [p.detach().clone() for p in net.parameters()]\n"
    "fit_info = dict(world=trainer.world_size, rank=trainer.global_rank, node=trainer.node_rank,\n"
    "    env=type(trainer.strategy.cluster_environment).__name__, group=dist.group.WORLD is group)\n"
)


def _replay(w_init: list[torch.Tensor], seen: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The weights one process reaches from rank 0's start with SGD on each step's gradient averaged
    over the ranks (what DDP's all-reduce gives), from the batches every rank recorded."""
    w_true = torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    weight = w_init[0].clone().requires_grad_()
    bias = w_init[1].clone().requires_grad_()
    steps = {len(s) for s in seen}
    assert len(steps) == 1, f"the ranks ran different numbers of steps: {steps}"
    for k in range(steps.pop()):
        grads = []
        for batches in seen:
            x = batches[k]
            loss = torch.nn.functional.mse_loss(x @ weight.T + bias, x @ w_true)
            grads.append(torch.autograd.grad(loss, [weight, bias]))
        with torch.no_grad():
            weight -= LR * (grads[0][0] + grads[1][0]) / 2
            bias -= LR * (grads[0][1] + grads[1][1]) / 2
    return [weight.detach(), bias.detach()]


def check_trained_together(cluster) -> None:
    """Every rank ends with the same weights: the replay's, from rank 0's start; the ranks saw
    different batches and started from different weights, so only synced gradients give this."""
    inits, ends, seen = cluster.pull("w_init"), cluster.pull("w_end"), cluster.pull("seen")
    assert not torch.equal(inits[0][0], inits[1][0])
    assert not any(torch.equal(a, b) for a, b in zip(seen[0], seen[1]))
    expected = _replay(inits[0], seen)
    for r, w in enumerate(ends):
        for got, want in zip(w, expected):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"rank {r}")
    assert not torch.equal(ends[0][0], inits[0][0])


def check_group_usable(ip, cluster) -> None:
    """nbtrain's group is still the one the next cell uses, and it reduces across both ranks."""
    run_cell(
        ip,
        # imports its own names: a rank replaced after an interrupt starts with a fresh namespace
        "import torch, torch.distributed as dist\n"
        "t = torch.tensor([float(rank + 1)])\n"
        "dist.all_reduce(t)\n"
        "after = (dist.is_initialized(), t.item(), dist.group.WORLD is group)\n",
    )
    assert cluster.pull("after") == [(True, 3.0, True), (True, 3.0, True)]


# ------------------------------------------------------------------------------------ tests
def _torchrun_env(tmp_path) -> dict[str, str]:
    """What torchrun (this torch's) adds to a worker's environment, from a real 2-worker run."""
    script = tmp_path / "dump.py"
    script.write_text(
        "import json, os, sys\n"
        "keys = set(json.loads(os.environ['PARENT_KEYS']))\n"
        "new = {k: v for k, v in os.environ.items() if k not in keys}\n"
        "open(sys.argv[1] + os.environ['RANK'], 'w').write(json.dumps(new))\n"
    )
    env = dict(os.environ)
    env["PARENT_KEYS"] = json.dumps([*env, "PARENT_KEYS"])
    out = tmp_path / "env"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
    subprocess.run([*cmd, str(out)], env=env, check=True, capture_output=True, timeout=120)
    return json.loads((tmp_path / "env1").read_text())


def test_every_rank_has_torchrun_environment(ip, cluster, tmp_path):
    torchrun = _torchrun_env(tmp_path)
    wanted = sorted(set(torchrun) - AGENT_ONLY)
    assert {"GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE"} <= set(wanted)
    cluster.push({"wanted": wanted})
    run_cell(
        ip,
        "import os, sys\nenv = {k: os.environ.get(k) for k in wanted}\nps1 = hasattr(sys, 'ps1')",
    )
    envs = cluster.pull("env")
    assert cluster.pull("ps1") == [False, False]  # not an interactive prompt, to libraries
    for r, env in enumerate(envs):
        missing = [k for k, v in env.items() if v is None]
        assert not missing, f"rank {r} lacks {missing}"
        assert env["RANK"] == env["ROLE_RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("0", "1")  # one node
        assert env["TORCHELASTIC_RUN_ID"] == cluster.cluster_id
        # how many times the group was re-created (test_environment_follows_reinit_... re-creates
        # it twice on this module's cluster, in whichever order the tests run); torchrun's first
        # run says 0, as a fresh cluster does
        assert env["TORCHELASTIC_RESTART_COUNT"] == str(cluster.reinits)
        # the values torchrun gives every run of one role, as torchrun gives them
        for k in ("ROLE_NAME", "TORCHELASTIC_MAX_RESTARTS"):
            assert env[k] == torchrun[k], k
    assert torchrun["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_lightning_trainer_ddp(ip, cluster):
    cluster.push({"DEVICES": 2, "NODES": 1})
    out = run_cell(ip, LIGHTNING_FIT)
    assert "not compatible with an interactive environment" not in out
    info = cluster.pull("fit_info")
    assert [i["rank"] for i in info] == [0, 1]
    for i in info:
        # Lightning found torchrun's environment and kept nbtrain's group (no new one)
        assert (i["world"], i["node"], i["env"], i["group"]) == (
            2,
            0,
            "TorchElasticEnvironment",
            True,
        )
    check_trained_together(cluster)
    check_group_usable(ip, cluster)


def test_lightning_fabric(ip, cluster):
    run_cell(
        ip,
        DATA + "import lightning as L\n"
        "fabric = L.Fabric(accelerator='cpu', strategy='ddp', devices=2)\n"
        "fabric.launch()\n"
        f"model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr={LR}))\n"
        "loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=8))\n"
        "for x, y in loader:\n"
        "    seen.append(x.clone())\n"
        "    opt.zero_grad()\n"
        "    fabric.backward(nn.functional.mse_loss(model(x), y))\n"
        "    opt.step()\n"
        "w_end = [p.detach().clone() for p in net.parameters()]\n"
        "fab = (fabric.world_size, fabric.global_rank)\n",
    )
    assert cluster.pull("fab") == [(2, 0), (2, 1)]
    check_trained_together(cluster)
    check_group_usable(ip, cluster)


def test_accelerate(ip, cluster):
    run_cell(
        ip,
        DATA + "from accelerate import Accelerator\n"
        "acc = Accelerator(cpu=True)\n"
        f"opt = torch.optim.SGD(net.parameters(), lr={LR})\n"
        "model, opt, loader = acc.prepare(net, opt, torch.utils.data.DataLoader(data, batch_size=8))\n"
        "for x, y in loader:\n"
        "    seen.append(x.clone())\n"
        "    opt.zero_grad()\n"
        "    acc.backward(nn.functional.mse_loss(model(x), y))\n"
        "    opt.step()\n"
        "w_end = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]\n"
        "acc_info = (acc.distributed_type.value, acc.num_processes, acc.process_index)\n"
        "acc.end_training()  # destroys the process group under torchrun; nbtrain keeps it\n",
    )
    assert cluster.pull("acc_info") == [("MULTI_CPU", 2, 0), ("MULTI_CPU", 2, 1)]
    check_trained_together(cluster)
    check_group_usable(ip, cluster)


def test_plain_ddp_with_init_and_destroy(ip, cluster):
    run_cell(
        ip,
        DATA + "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\n"
        "model = DDP(net)\n"
        f"opt = torch.optim.SGD(model.parameters(), lr={LR})\n"
        "sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)\n"
        "for x, y in torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler):\n"
        "    seen.append(x.clone())\n"
        "    opt.zero_grad()\n"
        "    nn.functional.mse_loss(model(x), y).backward()\n"
        "    opt.step()\n"
        "w_end = [p.detach().clone() for p in net.parameters()]\n"
        "dist.destroy_process_group()  # as a torchrun script ends; nbtrain keeps the group\n",
    )
    check_trained_together(cluster)
    check_group_usable(ip, cluster)


def test_hf_trainer(ip, cluster, tiny, tmp_path):
    cluster.push({"model_dir": tiny, "out_dir": str(tmp_path / "hf")})
    run_cell(
        ip,
        "from transformers import AutoModelForCausalLM, Trainer, TrainingArguments\n"
        "model = AutoModelForCausalLM.from_pretrained(model_dir)\n"
        "w_init = [p.detach().clone() for p in model.parameters()]\n"
        "g = torch.Generator().manual_seed(0)\n"
        "rows = [{'input_ids': r, 'labels': r} for r in torch.randint(5, 200, (32, 16), generator=g)]\n"
        "seen = []\n"
        "def collate(batch):\n"
        "    ids = torch.stack([b['input_ids'] for b in batch])\n"
        "    seen.append(ids.clone())\n"
        "    return {'input_ids': ids, 'labels': ids}\n"
        "args = TrainingArguments(output_dir=out_dir, per_device_train_batch_size=4, max_steps=4,\n"
        "    learning_rate=1e-2, report_to=[], save_strategy='no', disable_tqdm=True, use_cpu=True,\n"
        "    logging_steps=1, seed=0)\n"
        "hf = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)\n"
        "res = hf.train()\n"
        "w_end = [p.detach().clone() for p in model.parameters()]\n"
        "hf_info = (args.world_size, args.process_index, res.global_step,\n"
        "    type(hf.model_wrapped).__name__)\n",
    )
    assert cluster.pull("hf_info") == [
        (2, 0, 4, "DistributedDataParallel"),
        (2, 1, 4, "DistributedDataParallel"),
    ]
    seen = cluster.pull("seen")
    rows0 = {tuple(r.tolist()) for b in seen[0] for r in b}
    rows1 = {tuple(r.tolist()) for b in seen[1] for r in b}
    assert rows0 and rows1 and not rows0 & rows1  # each rank trained on its own shard
    ends, inits = cluster.pull("w_end"), cluster.pull("w_init")
    # so equal weights at the end mean the gradients were averaged across the ranks
    for a, b in zip(ends[0], ends[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(ends[0], inits[0]))
    check_group_usable(ip, cluster)


def test_interrupted_lightning_fit_leaves_a_usable_group(ip, cluster, tmp_path):
    marker = tmp_path / "started"
    cluster.push({"DEVICES": 2, "NODES": 1, "marker": str(marker)})
    slow = LIGHTNING_FIT.replace(
        "        seen.append(x.clone())\n",
        "        seen.append(x.clone())\n"
        "        open(marker, 'w').close()\n"
        "        import time; time.sleep(0.05)\n",
    ).replace("max_epochs=2", "max_epochs=10_000")
    failed: dict[str, BaseException] = {}
    reinits = cluster.reinits

    def fit() -> None:
        try:
            cluster.execute(slow, live=False)
        except BaseException as e:
            failed["error"] = e

    runner = threading.Thread(target=fit)
    runner.start()
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), "the fit never started"
    cluster.interrupt()
    runner.join(60)
    assert not runner.is_alive()
    # Lightning catches the KeyboardInterrupt, shuts down and calls sys.exit(1)
    error = failed.get("error")
    assert isinstance(error, DistributedCellError)
    # Where the interrupt lands is a race: a rank caught inside DDP's all-reduce while its peer has
    # already left waits there, and nbtrain replaces it. Then the error must say so.
    if cluster.reinits > reinits:
        assert "replaced" in str(error) or "re-created" in str(error), str(error)
    cluster.repair_group()  # what nbtrain does after an interrupted %%distributed cell
    check_group_usable(ip, cluster)
    # ipykernel restores its SIGINT handler for every request, undoing Lightning's SIG_IGN
    assert cluster.run(lambda: signal.getsignal(signal.SIGINT) is signal.default_int_handler) == [
        True,
        True,
    ]


def test_environment_follows_reinit_and_replaced_engine(ip, cluster):
    def env():
        import os

        return {k: os.environ[k] for k in ("RANK", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")}

    before = cluster.run(env)
    count = cluster.reinits
    cluster.reinit_group()
    after = cluster.run(env)
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in after] == [str(count + 1)] * 2
    assert after[0]["MASTER_PORT"] == after[1]["MASTER_PORT"] != before[0]["MASTER_PORT"]
    # a replaced engine gets the whole environment too, and no prompt
    old_pid = cluster.ranks[1].pid
    os.kill(old_pid, signal.SIGKILL)
    assert wait_gone([old_pid]) == []
    cluster.restart()
    assert cluster.ranks[1].pid != old_pid
    fresh = cluster.run(env)
    assert [e["RANK"] for e in fresh] == ["0", "1"]
    assert [e["TORCHELASTIC_RESTART_COUNT"] for e in fresh] == [str(count + 2)] * 2
    run_cell(ip, "import sys, os, torch, torch.distributed as dist\nps1 = hasattr(sys, 'ps1')")
    assert cluster.pull("ps1") == [False, False]
    # and Lightning runs on it as on the first engines
    cluster.push({"DEVICES": 2, "NODES": 1})
    run_cell(ip, LIGHTNING_FIT)
    check_trained_together(cluster)
