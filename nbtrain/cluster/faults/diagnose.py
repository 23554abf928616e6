"""Where every rank is: stacks over the control channel, and which ranks wait in a collective.

In [1]: cluster.diagnose()        # twin of %nbtrain diagnose; works while a cell runs

Never stops anything: a report for the notebook, also shown when a cell passes its --timeout.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nbtrain.cluster.ranks.ranges import parse_ranks
from nbtrain.cluster.ranks.topology import compact, describe_ranks
from nbtrain.cluster.session import Session
from nbtrain.engine.faults import is_cell_file

log = logging.getLogger(__name__)

COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "wait",
}
# the world group's description in torch's flight recorder
WORLD = "default_pg"
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


@dataclass
class Diagnosis:
    """Where every rank is, and which ranks wait in a collective (`Cluster.diagnose()`)."""

    stacks: dict[int, dict[str, Any]]
    waiting: dict[int, str]  #: rank -> "all_reduce at <cell>:5" for ranks blocked in a collective
    other: dict[int, str]  #: rank -> what it does instead ("time.sleep at <cell>:7", "idle", ...)
    behind: list[
        int
    ]  #: ranks that have not entered the collective others wait in (flight recorder)
    text: str
    took: float = 0.0

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)


def _frames(stack: str) -> list[tuple[str, int, str]]:
    return [(m["file"], int(m["line"]), m["fn"]) for m in _FRAME.finditer(stack)]


def _main_thread(info: dict[str, Any]) -> dict[str, Any] | None:
    for t in info.get("threads", []):
        if t.get("main"):
            return t
    return None


def in_cell(info: dict[str, Any]) -> bool:
    """Whether the rank's main thread still runs the cell's own code (a frame of the cell is on its
    stack): a rank that was interrupted and is writing its traceback has left it."""
    main = _main_thread(info)
    frames = _frames(main["stack"]) if main and main.get("stack") else []
    return any(is_cell_file(f) for f, _line, _fn in frames)


def _user_site(frames: list[tuple[str, int, str]]) -> str:
    for file, line, fn in reversed(frames):
        if "/site-packages/" not in file and "/torch/" not in file:
            short = "<cell>" if is_cell_file(file) else file
            return f"{short}:{line} in {fn}"
    return ""


def classify(info: dict[str, Any]) -> tuple[str, str]:
    """("collective" | "busy" | "idle" | "silent", what) for one rank's stacks."""
    kind, what = _classify_stack(info)
    if kind in ("busy", "idle"):
        # an NCCL collective runs on the GPU after the CPU has moved on (to `.item()`, the next step,
        # or the end of the cell): the flight recorder still lists it as not completed
        pending = (info.get("collectives") or {}).get("pending") or []
        if pending:
            from nbtrain.engine.faults import describe_entry

            return "collective", f"{describe_entry(pending[0])}, not completed; meanwhile {what}"
    return kind, what


def _classify_stack(info: dict[str, Any]) -> tuple[str, str]:
    if info.get("error"):
        return "silent", info["error"]
    main = _main_thread(info)
    if main is None or not main.get("user_frames"):
        return "idle", "idle (no cell running)"
    frames = _frames(main["stack"])
    site = _user_site(frames)
    for file, _line, fn in reversed(frames):
        if "/torch/distributed/" in file and fn in COLLECTIVES:
            return "collective", f"{fn}" + (f", called at {site}" if site else "")
        if "/torch/autograd/" in file and fn in ("backward", "_engine_run_backward"):
            return "collective", "backward (DDP's gradient all-reduce runs in it)" + (
                f", called at {site}" if site else ""
            )
    file, line, fn = frames[-1] if frames else ("?", 0, "?")
    code = main["stack"].rstrip().splitlines()[-1].strip() if main.get("stack") else ""
    what = f"`{code}`" if code and not code.startswith("File ") else fn
    return "busy", f"{what} ({site or f'{file}:{line}'})"


def _pg_order(pg: str) -> tuple[int, str]:
    """Process groups in the order they were made (torch names them 0, 1, 2, ...)."""
    return (int(pg), "") if pg.isdigit() else (-1, pg)


def _group_seqs(
    stacks: dict[int, dict[str, Any]], named: dict[str, list[int]]
) -> dict[str, dict[int, tuple[int, str]]]:
    """Process group -> rank -> (last collective's sequence number, op), from each rank's recorder.

    Sequence numbers count per process group, so only ranks of one group are comparable. A group is
    keyed by its description: `default_pg` for the world, the name for `%nbtrain groups` (nbtrain
    passes it as torch's `group_desc`), `pg <name>` for a group the user made without one. A member
    of a world or named group whose recorder holds none of its collectives has run none there (#0).
    """
    recorded: dict[int, dict[str, dict[str, Any]]] = {}
    newest: dict[str, str] = {}  # description -> its newest process group
    for r, info in stacks.items():
        fr = info.get("collectives") or {}
        if not fr.get("available"):
            continue
        per = fr.get("groups")
        if per is None:  # an engine from before per-group records: its last entry, as the world's
            entries = fr.get("entries") or []
            per = {}
            if entries and entries[-1].get("seq") is not None:
                last = entries[-1]
                per = {"0": {"seq": last["seq"], "op": last.get("op", ""), "desc": WORLD}}
        recorded[r] = per
        for pg, g in per.items():
            desc = g.get("desc") or ""
            if desc and desc != "undefined" and _pg_order(pg) > _pg_order(newest.get(desc, "")):
                newest[desc] = pg
    out: dict[str, dict[int, tuple[int, str]]] = {}
    for r, per in recorded.items():
        for pg, g in per.items():
            desc = g.get("desc") or ""
            if desc and desc != "undefined":
                if newest[desc] != pg:
                    continue  # a group redefined since (`%nbtrain groups` destroys the old ones)
                key = desc
            else:
                key = f"pg {pg}"
            out.setdefault(key, {})[r] = (int(g["seq"]), str(g.get("op", "")))
        for key, members in [(WORLD, list(stacks)), *named.items()]:
            if r in members and r not in out.get(key, {}):
                out.setdefault(key, {})[r] = (0, "none yet")
    # a group where no rank has run a collective says nothing
    return {k: v for k, v in out.items() if any(s for s, _ in v.values())}


def diagnose(
    cluster: Session, ranks: Any = None, timeout: float = 8.0, pending: Sequence[int] | None = None
) -> Diagnosis:
    """Every rank's Python stacks (all threads), and which ranks wait in a collective and which do not."""
    t0 = time.monotonic()
    which = parse_ranks(ranks, cluster.world_size)
    alive = [r for r in which if r not in cluster.lost]
    stacks = cluster.stacks(alive, timeout=timeout, all_threads=True)
    for r in which:
        if r not in stacks:
            stacks[r] = {
                "host": cluster.ranks[r].host,
                "pid": cluster.ranks[r].pid,
                "threads": [],
                "error": "dead (ended or died earlier); run %nbtrain restart",
            }
    waiting: dict[int, str] = {}
    other: dict[int, str] = {}
    for r in sorted(stacks):
        kind, what = classify(stacks[r])
        (waiting if kind == "collective" else other)[r] = what
    named = dict(cluster.group_specs)
    behind: list[int] = []
    summary = []
    in_step: list[str] = []
    for key, seqs in sorted(_group_seqs(stacks, named).items(), key=lambda kv: kv[0] != WORLD):
        top = max(s for s, _ in seqs.values())
        ahead = sorted(r for r, (s, _) in seqs.items() if s == top)
        late = sorted(r for r, (s, _) in seqs.items() if s < top)
        op = seqs[ahead[0]][1]
        where = "" if key == WORLD else f", group {key} (ranks {compact(sorted(seqs))})"
        if late:
            behind.extend(r for r in late if r not in behind)
            summary.append(
                f"flight recorder{where}: {describe_ranks(cluster.ranks, ahead)} entered collective "
                f"#{top} ({op}); {describe_ranks(cluster.ranks, late)} did not "
                f"(last: {', '.join(f'rank {r} #{seqs[r][0]}' for r in late)})."
            )
        elif key == WORLD:
            in_step.insert(0, f"every rank's last collective is #{top} ({op})")
        else:
            in_step.append(f"group {key}'s ranks all at #{top}")
    behind.sort()
    if in_step:
        summary.append(f"flight recorder: {'; '.join(in_step)}.")
    not_done = {
        r: (info.get("collectives") or {}).get("pending") or []
        for r, info in sorted(stacks.items())
    }
    if any(not_done.values()):
        from nbtrain.engine.faults import describe_entry

        summary.append(
            "flight recorder, not completed: "
            + "; ".join(
                f"rank {r}: " + (", ".join(describe_entry(e) for e in p[:2]) if p else "none")
                for r, p in not_done.items()
            )
        )
    if waiting:
        summary.insert(
            0,
            f"waiting in a collective: {'; '.join(f'rank {r}: {w}' for r, w in sorted(waiting.items()))}",
        )
    if other:
        summary.insert(
            1 if waiting else 0,
            f"not in a collective: {'; '.join(f'rank {r}: {w}' for r, w in sorted(other.items()))}",
        )
    if waiting and [r for r in other if r not in cluster.lost]:
        summary.append(
            "The waiting ranks are blocked until the others reach the same collective; look at where "
            "those others are in the stacks below."
        )
    took = time.monotonic() - t0
    if pending is None:
        pending = [r for r in which if r in waiting or not other.get(r, "").startswith("idle")]
    text = "\n".join(summary) + "\n\n" + format_stacks(cluster, stacks, pending=pending)
    return Diagnosis(
        stacks=stacks, waiting=waiting, other=other, behind=behind, text=text, took=took
    )


def format_stacks(
    cluster: Session, stacks: dict[int, dict[str, Any]], pending: Sequence[int] = ()
) -> str:
    """Stacks labelled by rank and host; the main thread first, engine machinery threads summarised."""
    out = []
    for rank in sorted(stacks):
        info = stacks[rank]
        host = info.get("host", cluster.ranks[rank].host)
        state = "still running" if rank in pending else "finished"
        out.append(f"--- rank {rank} on {host} (pid {info.get('pid')}, {state}) ---")
        if info.get("error"):
            out.append(f"  {info['error']}")
        fr = info.get("collectives") or {}
        if fr.get("pending"):
            from nbtrain.engine.faults import describe_entry

            out.append(f"  not completed (flight recorder, {fr.get('recorder', 'torch')}):")
            out.extend(f"    {describe_entry(e)}" for e in fr["pending"])
        for t in info.get("threads", []):
            if not t["user_frames"] and not t["main"]:
                continue
            out.append(f"  thread {t['thread']}{' (main)' if t['main'] else ''}:")
            out.extend("  " + line for line in t["stack"].rstrip().splitlines())
    return "\n".join(out)
