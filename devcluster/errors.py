"""The API's failures as Kubernetes answers them: an HTTP status and a `Status` object with a reason and a message
that kubectl prints (`Error from server (NotFound): pods "x" not found`). kmock renders `KubernetesError`."""

from __future__ import annotations

from typing import Any

import kmock


def _error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=details or {"causes": []})


def _what(resource: kmock.resource) -> str:
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def not_found(resource: kmock.resource, name: str) -> kmock.KubernetesError:
    return _error(404, "NotFound", f'{_what(resource)} "{name}" not found',
                  name=name, group=resource.group, kind=resource.plural)


def unknown_resource(path: str) -> kmock.KubernetesError:
    return _error(404, "NotFound", f"the server could not find the requested resource ({path})")


def already_exists(resource: kmock.resource, name: str) -> kmock.KubernetesError:
    return _error(409, "AlreadyExists", f'{_what(resource)} "{name}" already exists',
                  name=name, group=resource.group, kind=resource.plural)


def conflict(resource: kmock.resource, name: str, why: str) -> kmock.KubernetesError:
    return _error(409, "Conflict", f'Operation cannot be fulfilled on {_what(resource)} "{name}": {why}',
                  name=name, group=resource.group, kind=resource.plural)


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def forbidden(resource: kmock.resource, name: str, why: str) -> kmock.KubernetesError:
    return _error(403, "Forbidden", f'{_what(resource)} "{name}" is forbidden: {why}',
                  name=name, group=resource.group, kind=resource.plural)


def invalid(resource: kmock.resource, name: str, message: str) -> kmock.KubernetesError:
    return _error(422, "Invalid", f'{_what(resource)} "{name}" is invalid: {message}',
                  name=name, group=resource.group, kind=resource.plural)


def bad_request(message: str) -> kmock.KubernetesError:
    return _error(400, "BadRequest", message)


def method_not_allowed(message: str) -> kmock.KubernetesError:
    return _error(405, "MethodNotAllowed", message)


def unsupported_media_type(content_type: str) -> kmock.KubernetesError:
    return _error(415, "UnsupportedMediaType", f"the body of the request was in {content_type}, which the local "
                  "API server does not read: send JSON")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A Status object, as a watch's ERROR event carries it."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}
