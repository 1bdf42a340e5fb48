"""Settings from `SHARDWISE_*` environment variables that Kubernetes' service links cannot hijack.

A kubelet gives every container of a pod with `enableServiceLinks` (the default) variables for each Service of its
namespace: a Service `shardwise-metrics` yields `SHARDWISE_METRICS_PORT=tcp://10.96.47.183:9090`, which would be
read as the metrics port. The pods shardwise makes turn service links off, but a pod made by someone else, or a
chart without that field, still gets them. So a value of the service-link form (`tcp://`, `udp://` or
`sctp://` then host:port) is never taken as one of our settings: the option keeps its default.

The names the kubelet makes are `X_SERVICE_HOST`, `X_SERVICE_PORT[_NAME]`, `X_PORT` and `X_PORT_<n>_<PROTO>[_PROTO|
_PORT|_ADDR]`. Only the `X_PORT` form can match a name of ours (`SHARDWISE_METRICS_PORT`); `is_link_name` lets a test
check that no setting takes a name of the other forms.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_LINK_VALUE = re.compile(r"^(tcp|udp|sctp)://[^\s/]+:\d+$", re.IGNORECASE)
_LINK_NAME = re.compile(r"^[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
                        r"|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)$")


def is_service_link(value: str) -> bool:
    """Whether `value` has the form of a service-link variable's value (tcp://10.96.0.1:443)."""
    return bool(_LINK_VALUE.match(value.strip()))


def is_link_name(name: str) -> bool:
    """Whether a kubelet may set a variable of this name for some Service (other than the X_PORT form)."""
    return bool(_LINK_NAME.match(name))


def own(name: str, default: str = "", environ: Mapping[str, str] | None = None) -> str:
    """The variable's value, or `default` when it is unset or holds a service link's value."""
    value = (os.environ if environ is None else environ).get(name)
    if value is None or is_service_link(value):
        return default
    return value


def own_or_none(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    value = own(name, "", environ)
    return value or None
