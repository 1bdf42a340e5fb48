"""The route table of a deployment's router: which DPA groups take new requests, and where their leaders are.

`table()` is a pure function of the deployment's status and pods; `push()` sends it to every router pod whose
table differs. The reconciler pushes on every step, and the elastic state machine pushes before it drains a
group, so the router stops choosing a group before the group stops admitting.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shardwise.agents.client import RouterClient

log = logging.getLogger("shardwise.controllers.routes")


@dataclass(frozen=True)
class Leader:
    """A pod that leads DPA groups: its URL (port 8000), its groups, and whether it takes new requests."""

    url: str
    groups: tuple[int, ...]
    admitting: bool


def table(model: str, world: int, leaders: Iterable[Leader]) -> dict[str, Any]:
    groups = sorted(({"group": g, "url": p.url, "admitting": p.admitting} for p in leaders for g in p.groups),
                    key=lambda e: int(e["group"]))  # type: ignore[call-overload]
    body: dict[str, Any] = {"model": model, "world": world, "groups": groups}
    body["version"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return body


def push(routers: Mapping[str, str], token: str, routes: dict[str, Any]) -> dict[str, str]:
    """Send `routes` to each router (pod name -> base URL) whose version differs; pod name -> error for those
    that could not take it (a router that is starting: the next step tries again)."""
    errors: dict[str, str] = {}
    for pod, url in sorted(routers.items()):
        client = RouterClient(url, token)
        try:
            if client.describe().get("version") != routes["version"]:
                client.put_routes(routes)
        except OSError as e:
            errors[pod] = f"{type(e).__name__}: {e}"
        except ValueError as e:
            errors[pod] = f"bad answer: {e}"
    return errors
