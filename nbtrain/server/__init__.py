"""The jupyter_server extension: REST over this user's clusters and training runs.

It serves ``/nbtrain/api/`` for the JupyterLab "Training" sidebar. Enabled by the config file
``etc/jupyter/jupyter_server_config.d/nbtrain.json`` that the wheel installs; check it with
``jupyter server extension list``.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "nbtrain.server"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Register the handlers on the running server (called once by jupyter_server)."""
    from nbtrain.server.handlers import setup_handlers

    setup_handlers(server_app.web_app)
    server_app.log.info("nbtrain: training API at %snbtrain/api/", server_app.base_url)


# the classic notebook server and older jupyter_server look for the unprefixed name
load_jupyter_server_extension = _load_jupyter_server_extension
