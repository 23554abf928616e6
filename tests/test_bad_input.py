"""Bad input in bulk: each gets a specific message naming the problem, no traceback into nbtrain's
internals, and nothing is written (no file, no run record, no cluster process)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

import nbtrain
from nbtrain.errors import NbtrainError

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad-input")
    (d / "model").mkdir()
    (d / "train.jsonl").write_text('{"text": "hello"}\n')
    (d / "broken.jsonl").write_text('{"text": "hello"}\n{"text": \n')
    (d / "notext.jsonl").write_text('{"foo": "bar"}\n')
    (d / "empty.jsonl").write_text("")
    (d / "train.txt").write_text("hello\n")
    (d / "afile").write_text("x")
    from nbtrain.model.tiny import make_tiny_model

    make_tiny_model(d / "tiny")
    return d


@pytest.fixture(scope="module")
def one_rank():
    c = nbtrain.start(n=1, force=True)
    yield c
    c.stop()


def _snapshot(root: Path) -> set[str]:
    # the test's own folder and run registry (the profile folder is shared with other sessions: a new
    # cluster shows up as a new child process instead)
    seen = {str(p) for p in root.rglob("*")}
    runs = Path(os.environ["NBTRAIN_HOME"]) / "runs"
    seen |= {str(p) for p in runs.glob("*")} if runs.exists() else set()
    return seen


def _ipp_processes() -> set[int]:
    out = set()
    for p in psutil.process_iter(["pid", "cmdline", "ppid"]):
        cmd = " ".join(p.info["cmdline"] or [])
        # our own clusters only: children of this test process
        if "ipyparallel" in cmd and p.info["ppid"] == os.getpid():
            out.add(p.info["pid"])
    return out


def _base(files, **kw):
    return {
        "model": str(files / "tiny"),
        "data": str(files / "train.jsonl"),
        "output_dir": str(files / "out"),
        "max_steps": 2,
        **kw,
    }


# (id, what to call, expected words in the message)
def _sft(**kw):
    return lambda ip, f, c: nbtrain.SFTConfig(**_base(f, **kw))


def _sft_path(key, name, **kw):
    return lambda ip, f, c: nbtrain.SFTConfig(**_base(f, **{key: str(f / name)}, **kw))


def _finetune(**kw):
    return lambda ip, f, c: nbtrain.finetune(nbtrain.SFTConfig(**_base(f, **kw)))


def _finetune_path(key, name, **kw):
    return lambda ip, f, c: nbtrain.finetune(
        nbtrain.SFTConfig(**_base(f, **{key: str(f / name)}, **kw))
    )


def _magic(line):
    return lambda ip, f, c: ip.run_line_magic("nbtrain", line)


def _cell(line, code="print(1)"):
    return lambda ip, f, c: ip.run_cell_magic("distributed", line, code)


CASES = [
    # %nbtrain
    ("start -n 0", _magic("start -n 0"), ["start at least one engine"]),
    ("start -n two", _magic("start -n two"), ["not a whole number"]),
    ("start --timeout -5", _magic("start --timeout -5"), ["--timeout", "positive"]),
    ("start --backend mpi", _magic("start --backend mpi"), ["invalid choice: 'mpi'"]),
    (
        "start --hosts, no launcher",
        _magic("start -n 1 --hosts node1:2,node2:2"),
        ["--hosts", "no --launcher was given", "--launcher ssh"],
    ),
    ("unknown subcommand", _magic("frobnicate"), ["invalid choice: 'frobnicate'"]),
    ("diagnose --timeout 0", _magic("diagnose --timeout 0"), ["--timeout", "positive"]),
    ("restart --timeout x", _magic("restart --timeout x"), ["not a number of seconds"]),
    (
        "attach unknown cluster",
        _magic("attach nbtrain-doesnotexist"),
        ["nbtrain-doesnotexist", "is not running"],
    ),
    # %%distributed
    ("--output everything", _cell("--output everything"), ["everything"]),
    ("--ranks 0,5", _cell("--ranks 0,5"), ["outside the world of 1"]),
    ("--ranks a-b", _cell("--ranks a-b"), ["a-b"]),
    ("--timeout -1", _cell("--timeout -1"), ["--timeout -1", "positive"]),
    ("unknown cell option", _cell("--frob"), ["%%distributed", "--frob"]),
    # Python API
    ("start(n=0)", lambda ip, f, c: nbtrain.start(n=0), ["asks for no engines"]),
    ("start(n='two')", lambda ip, f, c: nbtrain.start(n="two"), ["not a whole number"]),
    (
        "start(backend='mpi')",
        lambda ip, f, c: nbtrain.start(n=1, backend="mpi"),
        ["unknown backend 'mpi'"],
    ),
    (
        "start(timeout=0)",
        lambda ip, f, c: nbtrain.start(n=1, timeout=0, force=True),
        ["--timeout 0", "positive"],
    ),
    (
        "start again without force",
        lambda ip, f, c: nbtrain.start(n=1),
        ["already running", "--force"],
    ),
    ("run on rank 3", lambda ip, f, c: c.run(len, [], ranks=3), ["outside the world of 1"]),
    ("diagnose ranks='x'", lambda ip, f, c: c.diagnose(ranks="x"), ["'x'"]),
    (
        "finetune(dict)",
        lambda ip, f, c: nbtrain.finetune({"model": "x"}),
        ["needs an nbtrain.SFTConfig", "dict"],
    ),
    # SFTConfig
    ("model folder missing", _sft_path("model", "nope"), ["model folder", "does not exist"]),
    ("model empty", _sft(model=""), ["model is required"]),
    ("data file missing", _sft_path("data", "missing.jsonl"), ["missing.jsonl", "not found"]),
    ("data suffix", _sft_path("data", "train.txt"), ["unknown suffix"]),
    ("lora_r=0", _sft(lora_r=0), ["lora_r=0"]),
    ("learning_rate='fast'", _sft(learning_rate="fast"), ["learning_rate='fast'"]),
    ("save_steps=0", _sft(save_steps=0), ["save_steps=0"]),
    ("max_steps=2.5", _sft(max_steps=2.5), ["max_steps=2.5"]),
    ("seed='x'", _sft(seed="x"), ["seed='x'", "integer"]),
    ("dtype=float16", _sft(dtype="float16"), ["float16", "bfloat16"]),
    ("lr scheduler", _sft(lr_scheduler_type="cosine_annealing"), ["cosine_annealing"]),
    ("resume missing", _sft_path("resume", "no-ckpt"), ["resume checkpoint", "not found"]),
    # malformed data and folders, found by finetune before any write
    ("broken jsonl", _finetune_path("data", "broken.jsonl"), ["broken.jsonl"]),
    ("rows without text", _finetune_path("data", "notext.jsonl"), ["notext.jsonl"]),
    ("empty data", _finetune_path("data", "empty.jsonl"), ["empty.jsonl"]),
    ("output_dir is a file", _finetune_path("output_dir", "afile"), ["is a file"]),
    (
        "resume latest, nothing there",
        _finetune(resume="latest"),
        ["resume='latest'", "no complete checkpoint"],
    ),
]


@pytest.mark.parametrize("name, call, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_specific_message_and_writes_nothing(name, call, words, ip, files, one_rank):
    before_files = _snapshot(files)
    before_procs = _ipp_processes()
    with pytest.raises(NbtrainError) as info:
        call(ip, files, one_rank)
    err = info.value
    text = str(err)
    for w in words:
        assert w in text, f"{name}: {w!r} not in {text!r}"
    # what IPython shows is the message, not a traceback into nbtrain's internals
    shown = "\n".join(err._render_traceback_())
    assert "Traceback" not in shown and 'File "' not in shown
    assert _snapshot(files) == before_files, f"{name} wrote something"
    assert _ipp_processes() - before_procs == set(), f"{name} left processes"
    assert nbtrain.current_cluster() is one_rank  # the running cluster is untouched


def test_at_least_25_cases():
    assert len(CASES) >= 25
