"""`%nbtrain start --launcher slurm`: the batch script and the settings (always), and real clusters on
a real single-machine Slurm (munged, slurmctld and slurmd started by scripts/slurm-testbed.sh).

The real-Slurm tests are marked `slurm` and skip, saying why, only where that Slurm cannot be
started (not root, slurm-wlm not installed, or the daemons fail here).
"""

from __future__ import annotations

import _thread
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

import nbtrain
from nbtrain.cluster import facade as core
from nbtrain.cluster import options
from nbtrain.cluster.launch import LaunchOptions, parse_launch, slurm
from nbtrain.errors import ClusterError, ConfigError
from tests.conftest import cluster_processes, wait_gone

REPO = Path(__file__).resolve().parents[3]
TESTBED = REPO / "scripts" / "slurm-testbed.sh"


def _kids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _cluster_pids(cluster_id: str) -> list[str]:
    """Processes of one cluster anywhere on this machine (Slurm's are not our children)."""
    found = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("IPP_CLUSTER_ID") == cluster_id:
                found.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        except psutil.Error:
            continue
    return found


# -- the batch script ------------------------------------------------------------------------------


def test_batch_script_has_every_directive_and_the_engine_command():
    lo = LaunchOptions(
        launcher="slurm",
        nodes=2,
        gpus_per_node=4,
        partition="gpu",
        account="proj-7",
        time="02:00:00",
        slurm_args="--qos=high --constraint=a100",
        remote_python="/opt/env/bin/python",
    )
    script = slurm.batch_script(lo)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    for directive in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",  # one engine per GPU
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj-7",
        "#SBATCH --time=02:00:00",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=a100",
        "#SBATCH --export=ALL",
        "#SBATCH --output={output_file}",
        "#SBATCH --job-name=nbtrain-{cluster_id}",
    ):
        assert directive in lines, directive
    # sbatch reads #SBATCH lines only before the first command
    last_directive = max(i for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    assert lines[last_directive + 1] == "srun --kill-on-bad-exit=0 {program_and_args}"


def test_batch_script_rendered_by_ipyparallel(tmp_path):
    """The template as ipyparallel's own Slurm launcher fills it in: the engine command is
    nbtrain's engine entry point with the Python given, and the job name carries the cluster id."""
    lo = LaunchOptions(
        launcher="slurm", nodes=3, engines_per_node=2, time="90", remote_python="/opt/py"
    )
    es = slurm.SlurmEngineSet(
        profile_dir=str(tmp_path),
        cluster_id="nbtrain-abc",
        batch_template=slurm.batch_script(lo),
        batch_file_name=str(tmp_path / "job.sbatch"),
        engine_cmd=["/opt/py", "-m", "nbtrain.engine.boot"],
    )
    es.write_batch_script(6)
    text = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --job-name=nbtrain-nbtrain-abc" in text
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=2\n" in text
    assert "--gpus-per-node" not in text and "--partition" not in text
    assert "#SBATCH --time=90" in text
    assert f"#SBATCH --output={es.output_file}" in text
    assert "srun --kill-on-bad-exit=0 /opt/py -m nbtrain.engine.boot" in text
    assert os.access(tmp_path / "job.sbatch", os.X_OK)


def test_engines_per_node_defaults():
    assert options.engines_per_node(LaunchOptions(launcher="slurm")) == 1  # CPU nodes
    assert options.engines_per_node(LaunchOptions(launcher="slurm", gpus_per_node=8)) == 8
    lo = LaunchOptions(launcher="slurm", gpus_per_node=8, engines_per_node=2)
    assert options.engines_per_node(lo) == 2
    assert LaunchOptions(launcher="slurm").nodes == 1


@pytest.mark.parametrize(
    "value", ["90", "30:00", "02:00:00", "1-0", "1-12:00", "2-12:30:00", "UNLIMITED"]
)
def test_time_limits_sbatch_takes(value):
    assert options.check_time(value) == value


# -- bad input: a ConfigError before anything runs -------------------------------------------------


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(nodes=0), ["--nodes 0", "at least 1"]),
        (dict(nodes=-2), ["--nodes -2"]),
        (dict(nodes="two"), ["--nodes 'two'"]),
        (dict(gpus_per_node=-1), ["--gpus-per-node -1"]),
        (dict(engines_per_node=0), ["--engines-per-node 0"]),
        (dict(gpus_per_node=2, engines_per_node=4), ["more than --gpus-per-node 2"]),
        (dict(time="2h"), ["--time '2h'", "02:00:00"]),
        (dict(time="99:99"), ["--time '99:99'"]),
        (dict(time="1:2:3:4"), ["--time '1:2:3:4'"]),
        (dict(time="1-25:00:00"), ["--time '1-25:00:00'"]),
        (dict(partition="gpu nodes"), ["--partition 'gpu nodes'", "sinfo -s"]),
        (dict(account="a\n#SBATCH --x"), ["--account"]),
        (dict(slurm_args=["qos=high"]), ["--slurm-args 'qos=high'", "--qos=high"]),
        (dict(hosts="node1:2"), ["--hosts is a setting of --launcher ssh or --launcher mpi"]),
        (dict(ssh_args="-F x"), ["--ssh-args is a setting of --launcher ssh"]),
        (dict(mpi_args="--oversubscribe"), ["--mpi-args is a setting of --launcher mpi"]),
        (dict(n=4), ["-n is a setting of --launcher local or --launcher mpi", "--nodes"]),
    ],
)
def test_bad_slurm_settings_start_nothing(kw, words):
    before = _kids()
    with pytest.raises(ConfigError) as e:
        nbtrain.start(launcher="slurm", **kw)
    for w in words:
        assert w in str(e.value)
    assert core.current_cluster() is None
    assert _kids() - before == set()


@pytest.mark.parametrize(
    "launcher, kw, words",
    [
        ("ssh", dict(hosts="localhost", nodes=2), ["--nodes is a setting of --launcher slurm"]),
        ("ssh", dict(hosts="localhost", partition="gpu"), ["--partition", "--launcher slurm"]),
        ("ssh", dict(hosts="localhost", time="10"), ["--time is a setting of --launcher slurm"]),
        ("mpi", dict(gpus_per_node=4), ["--gpus-per-node is a setting of --launcher slurm"]),
        ("local", dict(nodes=2), ["need launcher='ssh', 'slurm', 'mpi' or 'ray'"]),
        ("pbs", dict(nodes=2), ["unknown launcher 'pbs'"]),
    ],
)
def test_settings_of_another_launcher_are_refused(launcher, kw, words):
    with pytest.raises(ConfigError) as e:
        parse_launch(launcher, kw)
    for w in words:
        assert w in str(e.value)


def test_magic_with_another_launchers_option_starts_nothing(ip):
    before = _kids()
    with pytest.raises(ConfigError, match="--nodes is a setting of --launcher slurm"):
        ip.run_line_magic("nbtrain", "start --launcher mpi -n 2 --nodes 2")
    with pytest.raises(ConfigError, match="-n is a setting of --launcher local or --launcher mpi"):
        ip.run_line_magic("nbtrain", "start --launcher slurm -n 2")
    with pytest.raises(ConfigError, match="--nodes.*'0' is not a whole number at least 1"):
        ip.run_line_magic("nbtrain", "start --launcher slurm --nodes 0")
    with pytest.raises(ConfigError, match="--time '2 hours' is not a Slurm time limit"):
        ip.run_line_magic("nbtrain", "start --launcher slurm --time '2 hours'")
    assert core.current_cluster() is None
    assert _kids() - before == set()


def test_sbatch_missing_names_the_command_and_the_fix(ip, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands anywhere
    before = _kids()
    with pytest.raises(ConfigError) as e:
        ip.run_line_magic("nbtrain", "start --launcher slurm --nodes 2")
    msg = str(e.value)
    assert "sbatch, squeue, scancel are not on PATH" in msg
    assert (
        "login node" in msg and "apt install slurm-client" in msg and "Nothing was started" in msg
    )
    assert core.current_cluster() is None
    assert _kids() - before == set()


def test_magic_help_lists_the_slurm_and_mpi_options(ip, capsys):
    from nbtrain.magics import NbtrainMagics

    doc = NbtrainMagics.nbtrain.__doc__ or ""
    for option in (
        "--nodes",
        "--gpus-per-node",
        "--engines-per-node",
        "--partition",
        "--account",
        "--time",
        "--slurm-args",
        "--mpi-args",
        "--launcher slurm",
        "--launcher mpi",
    ):
        assert option in doc, option
    assert "not yet" not in doc
    ip.run_line_magic("nbtrain", "start --help")
    out = capsys.readouterr()
    assert "--gpus-per-node" in out.out + out.err and "mpiexec" in out.out + out.err


# -- a real Slurm on this machine ------------------------------------------------------------------


def _free_pair() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65000:
            try:
                with socket.socket() as s2:
                    s2.bind(("", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def slurm_bed(tmp_path_factory):
    """A single-node Slurm (this host, its CPUs) for this module; taken down at its end."""
    if os.geteuid() != 0:
        pytest.skip("a test Slurm needs root (slurmd runs the jobs)")
    if not Path("/usr/sbin/slurmctld").exists() or not Path("/usr/sbin/munged").exists():
        pytest.skip(
            "slurm-wlm and munge are not installed (sh scripts/testbed-deps.sh installs them)"
        )
    folder = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "NBTRAIN_SLURM_PORT": str(_free_pair())}
    t0 = time.monotonic()
    up = subprocess.run(
        ["sh", str(TESTBED), "up", str(folder)], capture_output=True, text=True, env=env, timeout=60
    )
    if up.returncode != 0:
        pytest.skip(f"the test Slurm did not start here: {up.stderr.strip()[-500:]}")
    print(f"slurm test bed up in {time.monotonic() - t0:.1f} s")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(folder / "slurm.conf")
    try:
        yield folder
    finally:
        subprocess.run(["sh", str(TESTBED), "down", str(folder)], env=env, timeout=60)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def _squeue(job_id: str | None = None) -> str:
    cmd = ["squeue", "-h", "-o", "%i %T %r %j"] + (["-j", job_id] if job_id else [])
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()


def _assert_job_gone(job_id: str, cluster_id: str) -> None:
    assert _squeue(job_id) == ""
    deadline = time.monotonic() + 10
    while _cluster_pids(cluster_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _cluster_pids(cluster_id) == []


@pytest.mark.slurm
def test_slurm_cluster_all_reduce_ranks_and_stop(ip, slurm_bed, capsys):
    """Two engines as one real sbatch job: rank table, torchrun environment, a gloo all_reduce,
    then stop: the job leaves the queue and no process of the cluster is left."""
    t0 = time.monotonic()
    ip.run_line_magic(
        "nbtrain", "start --launcher slurm --nodes 1 --engines-per-node 2 --time 10 --timeout 90"
    )
    started = time.monotonic() - t0
    out = capsys.readouterr().out
    cluster = core.require_cluster()
    m = re.search(r"slurm job (\d+) running on (\S+)", out)
    assert m, out
    job_id, node = m.group(1), m.group(2)
    assert node == socket.gethostname()
    assert "submitting a Slurm job: 1 node(s) × 2 engine(s), time 10" in out
    assert "rank  host" in out and cluster.table() in out
    assert f"{job_id} RUNNING None nbtrain-{cluster.cluster_id}" in _squeue(job_id)

    def who():
        import os

        import torch
        import torch.distributed as dist

        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        keys += ("GLOO_SOCKET_IFNAME", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID")
        return t.item(), {k: os.environ.get(k) for k in keys}

    results = cluster.run(who)
    assert [r[0] for r in results] == [3.0, 3.0]  # 1 + 2 on both ranks
    for rank, (_, env) in enumerate(results):
        assert env["RANK"] == env["SLURM_PROCID"] == str(rank)
        assert env["LOCAL_RANK"] == env["SLURM_LOCALID"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["SLURM_JOB_ID"] == job_id
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert [r.host for r in cluster.ranks] == [node, node]
    ip.run_cell_magic(
        "distributed", "", "import torch.distributed as dist\nassert dist.get_world_size() == 2"
    )
    t1 = time.monotonic()
    ip.run_line_magic("nbtrain", "stop")
    print(f"slurm start {started:.1f} s, stop {time.monotonic() - t1:.1f} s")
    _assert_job_gone(job_id, cluster.cluster_id)
    assert not list(
        Path(cluster.ipp_cluster.profile_dir, "log").glob(f"slurm-{cluster.cluster_id}*")
    )


@pytest.mark.slurm
def test_pending_job_fails_after_timeout_naming_job_and_reason_and_is_cancelled(slurm_bed, capsys):
    # two nodes on a one-node cluster: Slurm keeps the job pending (PartitionNodeLimit)
    before = _kids()
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        nbtrain.start(launcher="slurm", nodes=2, timeout=6, quiet=False)
    elapsed = time.monotonic() - t0
    msg = str(e.value)
    m = re.search(r"slurm job (\d+) was still pending after --timeout 6 s \(reason: (\w+)\)", msg)
    assert m, msg
    assert m.group(2) == "PartitionNodeLimit"
    assert f"It was cancelled (scancel {m.group(1)})" in msg and "fewer --nodes" in msg
    assert f"slurm job {m.group(1)} pending (PartitionNodeLimit)" in capsys.readouterr().out
    assert elapsed < 20
    assert _squeue(m.group(1)) == ""
    assert core.current_cluster() is None
    assert psutil.wait_procs([psutil.Process(p) for p in _kids() - before], timeout=5)[1] == []


@pytest.mark.slurm
def test_interrupt_while_pending_cancels_the_job(slurm_bed):
    # a down partition: the job waits (PartitionDown) until the start is interrupted
    timer = threading.Timer(4.0, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            nbtrain.start(launcher="slurm", partition="closed", timeout=60)
    finally:
        timer.cancel()
    assert _squeue() == ""
    assert core.current_cluster() is None


@pytest.mark.slurm
def test_sbatch_refusal_and_unknown_partition_start_nothing(slurm_bed):
    before = {p.pid for p in cluster_processes()}
    with pytest.raises(ConfigError) as e:
        nbtrain.start(launcher="slurm", partition="nosuch", timeout=20)
    assert "--partition nosuch: this Slurm cluster has no such partition" in str(e.value)
    assert "debug, closed" in str(e.value)
    # GPUs on a partition without GPUs: sbatch's own message, and the fix
    with pytest.raises(ClusterError) as e:
        nbtrain.start(launcher="slurm", gpus_per_node=1, timeout=20)
    msg = str(e.value)
    assert "sbatch refused: Invalid generic resource (gres) specification" in msg
    assert "leave --gpus-per-node out on CPU nodes" in msg
    assert _squeue() == ""
    assert core.current_cluster() is None
    # the controller ran when sbatch refused: neither it nor its schedulers may be left
    assert wait_gone({p.pid for p in cluster_processes()} - before) == []


@pytest.mark.slurm
def test_job_that_fails_shows_its_output(slurm_bed):
    # the engines cannot start on the node: the job ends, and the start says so at once
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        nbtrain.start(launcher="slurm", remote_python="/nonexistent/python", timeout=60)
    msg = str(e.value)
    assert re.search(
        r"slurm job \d+ (failed|completed|completing|ended) before its engines registered", msg
    ), msg
    assert "/nonexistent/python" in msg and "--python" in msg
    # the output the message names is kept after a failed start
    log = re.search(r"Its output \((\S+)\)", msg)
    assert log and Path(log.group(1)).exists()
    Path(log.group(1)).unlink()
    assert time.monotonic() - t0 < 30
    assert _squeue() == ""


# timed: right after the check returns, its job must be out of the queue (no grace); under the other
# lane's load slurmd's clean-up kept it COMPLETING a moment longer
@pytest.mark.timed
@pytest.mark.slurm
def test_check_runs_the_probe_on_each_node_through_srun(ip, slurm_bed, capsys):
    """`%nbtrain check --partition`: one srun task per node, no job left; a partition that never
    runs anything fails after --timeout naming it, and leaves no job behind."""
    r = nbtrain.check(partition="debug", nodes=1, time="5")
    (facts,) = r.nodes
    assert r.source == "slurm" and r.ok
    assert facts["hostname"] == socket.gethostname()
    assert 1 <= facts["cpus_usable"] <= facts["cpus"]
    assert facts["nbtrain"] == nbtrain.__version__
    ip.run_line_magic("nbtrain", "check --partition debug --time 5")
    assert socket.gethostname() in capsys.readouterr().out
    assert "nbtrain-check" not in _squeue()
    with pytest.raises(ClusterError, match="got no nodes or no answer within 3 s"):
        nbtrain.check(partition="closed", timeout=3)
    deadline = time.monotonic() + 10
    while "nbtrain-check" in _squeue() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "nbtrain-check" not in _squeue()


# the Slurm recipe of docs/multinode.md on the test bed: each real cluster's name in it, and the test
# bed's. Every one must be found, so the page cannot change under the test unnoticed.
def _recipe_on_the_bed(code: str, tiny: str, tmp: Path) -> str:
    import sys

    from nbtrain.data.examples import instructions_path

    swaps = {
        'nodes=2, gpus_per_node=4, partition="gpu", account="proj",': "nodes=1, engines_per_node=2,",
        'time="04:00:00",': 'time="10",',
        'remote_python="/shared/envs/nbtrain/bin/python",': f"remote_python={sys.executable!r},",
        "timeout=1800,": "timeout=90,",
        '"HF_HOME": "/shared/hf"': f'"HF_HOME": {str(tmp / "hf")!r}',
        'model="Qwen/Qwen2.5-7B-Instruct"': f"model={tiny!r}",
        'data="/shared/data/train.jsonl"': f"data={str(instructions_path())!r}",
        'output_dir="/shared/runs/qwen7b"': f"output_dir={str(tmp / 'qwen7b')!r}",
        "max_steps=3000, save_steps=200,": "max_steps=4, save_steps=2, max_length=64,",
    }
    for old, new in swaps.items():
        if old in code:
            code = code.replace(old, new)
    return code


@pytest.mark.slurm
def test_the_docs_slurm_recipe_runs(ip, slurm_bed, tiny, tmp_path, capsys):
    from tests.test_docs import DOCS, SLURM_MARKER, snippets

    steps = snippets(DOCS / "multinode.md", SLURM_MARKER)
    assert len(steps) == 3  # start, train, stop
    codes = [_recipe_on_the_bed(code, str(tiny), tmp_path) for _, code in steps]
    for (line, _), after in zip(steps, codes):
        # every name of the page's cluster was replaced: nothing of /shared, gpu or proj is left
        for name in ("/shared", '"gpu"', '"proj"', "Qwen/"):
            assert name not in after, f"multinode.md:{line}: {name} is not replaced:\n{after}"
    try:
        for (line, _), code in zip(steps, codes):
            result = ip.run_cell(code, store_history=False)
            assert result.success, (
                f"multinode.md:{line}: {result.error_before_exec or result.error_in_exec}\n"
                f"{capsys.readouterr().out[-3000:]}"
            )
        out = capsys.readouterr().out
        assert re.search(r"slurm job \d+ running on", out), out
        assert (tmp_path / "qwen7b" / "adapter" / "adapter_config.json").exists()
        assert "cluster stopped" in out
    finally:
        if core.current_cluster() is not None:
            core.current_cluster().stop()


@pytest.mark.slurm
def test_preempted_job_checkpoints_and_resumes_to_the_uninterrupted_adapter(
    ip, slurm_bed, tiny, tmp_path, capsys
):
    """`scancel --signal=USR1` (what `--signal=USR1@90` sends before a preemption) while finetune runs
    in a Slurm job: every rank ends its step, one checkpoint is written, the cell fails with one
    message; in a new job, resume='latest' ends with the uninterrupted run's adapter."""
    from safetensors.torch import load_file

    from nbtrain.data.examples import instructions_path
    from nbtrain.errors import DistributedCellError

    ip.run_line_magic(
        "nbtrain", "start --launcher slurm --nodes 1 --engines-per-node 2 --time 10 --timeout 90"
    )
    job_id = re.search(r"slurm job (\d+) running on", capsys.readouterr().out).group(1)
    cluster = core.require_cluster()

    def cfg(out, **kw):
        base = dict(
            model=str(tiny), data=instructions_path(), output_dir=str(out), max_steps=8,
            per_device_train_batch_size=2, learning_rate=5e-3, logging_steps=1, save_steps=None,
            max_length=64, lora_dropout=0.0, seed=7,
        )  # fmt: skip
        return base | kw

    from tests.recipes.test_faults_resume import RUN as run
    from tests.recipes.test_faults_resume import SLOW_RUN as slow

    try:
        cluster.push({"cfg": cfg(tmp_path / "ref")})
        cluster.execute(run, live=False)
        ref = load_file(str(tmp_path / "ref" / "adapter" / "adapter_model.safetensors"))
        out = tmp_path / "preempted"
        cluster.push({"cfg": cfg(out)})

        def preempt():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                m = out / "metrics.jsonl"
                if m.is_file() and len(m.read_text().splitlines()) >= 3:
                    break
                time.sleep(0.05)
            subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)

        threading.Thread(target=preempt, daemon=True).start()
        with pytest.raises(DistributedCellError) as info:
            cluster.execute("import nbtrain\n" + slow, live=False)
        found = re.search(
            r"preempted at step (\d+)/8 on rank \d .*SIGUSR1\); checkpoint at", str(info.value)
        )
        assert found, str(info.value)
        step = int(found.group(1))
        assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{step}"]
        # every rank raised the same Preempted and nothing else (rank 0 once failed on the record)
        assert [(g["ename"], g["ranks"]) for g in info.value.failures] == [("Preempted", [0, 1])]
        # the job would be killed after the grace period: the resume runs in a new job
        ip.run_line_magic("nbtrain", "stop")
        ip.run_line_magic(
            "nbtrain",
            "start --launcher slurm --nodes 1 --engines-per-node 2 --time 10 --timeout 90",
        )
        cluster = core.require_cluster()
        cluster.push({"cfg": cfg(out, resume="latest")})
        cluster.execute(run, live=False)
        got = load_file(str(out / "adapter" / "adapter_model.safetensors"))
        for key in ref:
            torch_close = (got[key] - ref[key]).abs().max().item()
            assert torch_close < 1e-5, key
    finally:
        if core.current_cluster() is not None:
            core.current_cluster().stop()
