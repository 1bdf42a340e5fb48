"""A container's volumes as a process-backed kubelet can give them: a process has no mount namespace of its own, so
each volume is a folder of the machine and a path under a `mountPath` in the container's environment, command or
arguments is rewritten to that folder (a program that builds such a path itself is not redirected). Pure, apart
from writing the files of Secret and ConfigMap volumes.

- `secret` and `configMap`: their keys as files (every key, or the `items` listed at their `path`), written under
  `ROOT/NAME` with `defaultMode` (or an item's `mode`; 0644 by default), before the container starts; a missing
  Secret or ConfigMap that is not `optional` keeps the container from starting (`EnvError`, as the kubelet's
  FailedMount). Written once per start: a later change of the Secret reaches the container at its next start.
- `emptyDir`: an empty folder `ROOT/NAME` (kept across restarts of the container, gone with the pod).
- `hostPath`: the path itself.
- Others (persistentVolumeClaim, projected, ...) are not emulated: their mounts are left as written.
A mount's `subPath` is a path below its volume's folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .podenv import EnvError

Obj = Mapping[str, Any]


def sources(pod: Obj) -> tuple[set[str], set[str]]:
    """The names of the ConfigMaps and Secrets the pod's volumes hold."""
    configmaps, secrets = set(), set()
    for v in (pod.get("spec") or {}).get("volumes") or []:
        if v.get("configMap"):
            configmaps.add(v["configMap"]["name"])
        if v.get("secret"):
            secrets.add(v["secret"]["secretName"])
    return configmaps, secrets


def _write(folder: Path, data: Mapping[str, str], source: Obj) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    items = source.get("items")
    chosen = [(i["key"], i.get("path") or i["key"], i.get("mode")) for i in items] if items else \
        [(k, k, None) for k in data]
    for key, path, mode in chosen:
        if key not in data:
            if source.get("optional"):
                continue
            raise EnvError(f"the key {key!r} is not in the volume's source")
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(data[key])
        os.chmod(target, int(mode if mode is not None else source.get("defaultMode", 0o644)))


def prepare(pod: Obj, container: Obj, root: Path, *, configmaps: Mapping[str, Mapping[str, str] | None],
            secrets: Mapping[str, Mapping[str, str] | None]) -> dict[str, str]:
    """Give the container its volumes: {mountPath: folder}, the files of Secret and ConfigMap volumes written."""
    folders: dict[str, str] = {}
    for v in (pod.get("spec") or {}).get("volumes") or []:
        name, folder = v["name"], root / v["name"]
        if v.get("secret") or v.get("configMap"):
            source = v.get("secret") or v["configMap"]
            ref = source.get("secretName") or source.get("name")
            data = (secrets if v.get("secret") else configmaps).get(ref)
            if data is None:
                if not source.get("optional"):
                    raise EnvError(f"volume {name!r}: {'Secret' if v.get('secret') else 'ConfigMap'} {ref!r} "
                                   "not found")
                data = {}
            _write(folder, data, source)
            folders[name] = str(folder)
        elif "emptyDir" in v:
            folder.mkdir(parents=True, exist_ok=True)
            folders[name] = str(folder)
        elif v.get("hostPath"):
            folders[name] = str(v["hostPath"]["path"])
    mounts: dict[str, str] = {}
    for m in container.get("volumeMounts") or []:
        if m["name"] in folders:
            mounts[str(m["mountPath"]).rstrip("/") or "/"] = os.path.join(folders[m["name"]], m.get("subPath") or "")
    return mounts


def rewrite(value: str, mounts: Mapping[str, str]) -> str:
    """`value` with a leading mount path replaced by its folder (the longest mount path that matches)."""
    for path in sorted(mounts, key=len, reverse=True):
        if path == "/":
            continue
        if value == path:
            return mounts[path]
        if value.startswith(path + "/"):
            return os.path.join(mounts[path], value[len(path) + 1:])
    return value
