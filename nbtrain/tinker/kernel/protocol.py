"""What the tinker 0.38.0 SDK expects of a server, kept in one place: the losses, ids and paths.

Ids are the SDK's own: a session is a random hex string; a training model is
``f"{session_id}:train:{model_seq_id}"`` (the SDK derives that id itself after a create-via-load);
an ephemeral sampler is ``f"{session_id}:sample:{sampling_session_seq_id}"``. Checkpoints are
``tinker://{model_id}/weights/{name}`` (adapter and optimizer state) and
``tinker://{model_id}/sampler_weights/{name}`` (a peft adapter folder); each maps to
``<root>/<model folder>/<kind>/<name>`` and nothing a request names can leave ``root``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the losses `forward_backward` runs on the ranks (formulas in docs/tinker.md)
SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
#: losses the SDK names that nbtrain does not run
REFUSED_LOSSES = {
    "gspo": "its formula is not public",
    "stable_reinforce": "its formula is not public",
    "custom": "server-side custom losses are not supported; forward_backward_custom runs the loss "
    "in the client and works",
}
#: the folder kinds of a checkpoint path
KINDS = ("weights", "sampler_weights")

# a model id (ours, or one a saved path names) and a checkpoint name: no separators, no dot-dot
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,200}$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


class RequestError(Exception):
    """A request the service refuses: `status` is the HTTP status (400 bad request, 404 unknown)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        #: the refused request's model and seq_id, when known: its seq_id must not hold later ones
        self.model_id: str | None = None
        self.seq_id: int | None = None


def bad(message: str) -> RequestError:
    return RequestError(400, message)


def get_field(
    body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    """`body[key]`, checked to be a `kind` (bool is not an int); required unless `default` is given."""
    value = body.get(key, default)
    if value is ...:
        raise bad(f"the request lacks {key!r}.")
    if value is not None and not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise bad(f"{key!r} has the wrong type ({type(value).__name__}).")
    return value


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def sampler_id(session_id: str, seq_id: int) -> str:
    return f"{session_id}:sample:{seq_id}"


def check_loss(loss_fn: str) -> None:
    """A 400 for a loss the ranks do not run, naming the ones they do."""
    if loss_fn in SUPPORTED_LOSSES:
        return
    why = REFUSED_LOSSES.get(loss_fn, "it is not a loss the tinker protocol defines")
    msg = (
        f"loss_fn {loss_fn!r} is not supported by nbtrain's Tinker service ({why}). "
        f"Supported: {', '.join(SUPPORTED_LOSSES)}."
    )
    raise bad(msg)


def check_id(value: str, what: str = "model id") -> str:
    if not isinstance(value, str) or not _ID.match(value) or ".." in value:
        msg = f"{what} {value!r} is not valid: letters, digits and _ . : - only, no '..'."
        raise bad(msg)
    return value


def check_name(name: str) -> str:
    """A checkpoint name: one path component, so it can never leave the service folder."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        msg = (
            f"checkpoint name {name!r} is not valid: one name of letters, digits and _ . - "
            "(no '/', no '..', not absolute)."
        )
        raise bad(msg)
    return name


def folder_name(model: str) -> str:
    """The folder a model's runs and checkpoints live in (':' is awkward in shells and URLs)."""
    return check_id(model).replace(":", "_")


def tinker_path(model: str, kind: str, name: str) -> str:
    return f"tinker://{model}/{kind}/{name}"


def parse_path(path: str) -> tuple[str, str, str]:
    """`tinker://{model_id}/{kind}/{name}` -> (model_id, kind, name); a 400 for anything else."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        msg = (
            f"path {path!r} is not a tinker path: expected tinker://<model_id>/weights/<name> "
            "or tinker://<model_id>/sampler_weights/<name>, as save_state and "
            "save_weights_for_sampler return."
        )
        raise bad(msg)
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        msg = (
            f"path {path!r} is not a tinker checkpoint path: expected "
            "tinker://<model_id>/weights/<name> or tinker://<model_id>/sampler_weights/<name>."
        )
        raise bad(msg)
    return check_id(parts[0]), parts[1], check_name(parts[2])


def local_folder(root: Path, model: str, kind: str, name: str) -> Path:
    """Where a checkpoint lives under `root`; checked again after resolving, so a link cannot lead
    outside either."""
    base = root.resolve()
    folder = (base / folder_name(model) / kind / check_name(name)).resolve()
    if base not in folder.parents:
        msg = f"checkpoint {name!r} of {model!r} resolves outside the service folder {base}."
        raise bad(msg)
    return folder
