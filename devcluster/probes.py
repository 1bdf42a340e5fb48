"""Container probes as a kubelet runs them: one check (`check`) and the schedule around it (`Prober`).

Handlers: `httpGet` (a GET to the pod IP, or `host`, on `port`, a number or a container port's name, with `path`,
`scheme` and `httpHeaders`; a status from 200 to 399 succeeds, redirects are not followed), `tcpSocket` (a
connection opens) and `exec` (the command, run with the container's environment in its own process group, exits
0). A check that takes longer than `timeoutSeconds` fails. gRPC probes are not supported: they always fail.

Schedule: the first check `initialDelaySeconds` after the container started, then every `periodSeconds`; the
result flips to success after `successThreshold` consecutive successes and to failure after `failureThreshold`
consecutive failures (defaults 0, 10, 1, 1, 3 as in Kubernetes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Target:
    """Where a probe looks: the pod's IP, the container's named ports, its environment and working directory."""

    pod_ip: str
    ports: Mapping[str, int]
    env: Mapping[str, str]
    cwd: str


def _port(value: Any, ports: Mapping[str, int]) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if value in ports:
        return ports[value]
    raise ValueError(f"no container port named {value!r}")


async def _http(handler: Obj, target: Target, timeout: float) -> bool:
    scheme = str(handler.get("scheme") or "HTTP").lower()
    host = handler.get("host") or target.pod_ip
    path = handler.get("path") or "/"
    url = f"{scheme}://{host}:{_port(handler.get('port'), target.ports)}{path if path.startswith('/') else '/' + path}"
    headers = {h["name"]: h.get("value", "") for h in handler.get("httpHeaders") or []}
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # Kubernetes does not verify probes
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session, session.get(
            url, headers=headers, allow_redirects=False, ssl=context if scheme == "https" else False) as response:
        return 200 <= response.status < 400


async def _tcp(handler: Obj, target: Target, timeout: float) -> bool:
    host = handler.get("host") or target.pod_ip
    async with asyncio.timeout(timeout):
        _, writer = await asyncio.open_connection(host, _port(handler.get("port"), target.ports))
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    return True


async def _exec(handler: Obj, target: Target, timeout: float) -> bool:
    command = [str(part) for part in handler.get("command") or []]
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL, env=dict(target.env), cwd=target.cwd, start_new_session=True)
    try:
        async with asyncio.timeout(timeout):
            return await process.wait() == 0
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


async def check(probe: Obj, target: Target) -> bool:
    """Run the probe's handler once."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if probe.get("httpGet"):
            return await _http(probe["httpGet"], target, timeout)
        if probe.get("tcpSocket"):
            return await _tcp(probe["tcpSocket"], target, timeout)
        if probe.get("exec"):
            return await _exec(probe["exec"], target, timeout)
    except (OSError, TimeoutError, aiohttp.ClientError, ValueError):
        return False
    return False  # grpc, or no handler


Check = Callable[[Obj, Target], Awaitable[bool]]


class Prober:
    """Runs one probe on its schedule; `on_result(ok)` is called whenever the thresholded result is first known or
    changes. `first_result` waits until it is known."""

    def __init__(self, probe: Obj, target: Target, on_result: Callable[[bool], None], *,
                 check_once: Check = check) -> None:
        self.probe, self.target, self.on_result, self.check_once = probe, target, on_result, check_once
        self.result: bool | None = None

    async def run(self) -> None:
        delay, period = (float(self.probe.get(key) or default) for key, default in
                         (("initialDelaySeconds", 0), ("periodSeconds", 10)))
        needed = {True: int(self.probe.get("successThreshold") or 1), False: int(self.probe.get("failureThreshold")
                                                                                or 3)}
        streak: list[bool] = []
        await asyncio.sleep(delay)  # the probe's own schedule, not a synchronisation
        while True:
            ok = await self.check_once(self.probe, self.target)
            streak = [*streak, ok] if streak and streak[-1] == ok else [ok]
            if len(streak) >= needed[ok] and self.result != ok:
                self.result = ok
                self.on_result(ok)
            await asyncio.sleep(period)


def named_ports(container: Obj) -> dict[str, int]:
    return {str(p["name"]): int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name")}


def probes_of(container: Obj) -> Sequence[tuple[str, Obj]]:
    return [(kind, container[kind]) for kind in ("startupProbe", "readinessProbe", "livenessProbe")
            if container.get(kind)]
