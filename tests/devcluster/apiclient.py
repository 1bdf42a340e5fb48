"""A small Kubernetes API client over urllib for the local API server's tests: JSON in, (status, JSON) out."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferencedeployments.shardwise.io.yaml"
EXAMPLE = ROOT / "examples" / "tiny-moe.yaml"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"


class Client:
    """Just enough of a Kubernetes client over urllib: JSON in, (status, JSON) out, and watch streams. By default it
    sends no credentials (the plain-HTTP port serves that as the admin); `token` sends `Bearer TOKEN`, or
    `authorization` a header of its own; `ca_pem` trusts a server's CA (for its HTTPS URL)."""

    def __init__(self, url: str, *, token: str | None = None, authorization: str | None = None,
                 ca_pem: bytes | None = None) -> None:
        self.url = url
        self.headers = {"Authorization": authorization if authorization is not None else f"Bearer {token}"} \
            if token is not None or authorization is not None else {}
        self.context = ssl.create_default_context(cadata=ca_pem.decode()) if ca_pem is not None else None

    def call(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
             accept: str = "application/json", **params: Any) -> tuple[int, Any]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path + query, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": accept, **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=5, context=self.context) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def ok(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        status, answer = self.call(method, path, body, **kwargs)
        assert 200 <= status < 300, (status, answer)
        return answer

    def get(self, path: str, **params: Any) -> Any:
        return self.ok("GET", path, **params)

    def create(self, path: str, body: dict[str, Any]) -> Any:
        return self.ok("POST", path, body)

    def patch(self, path: str, body: Any, content_type: str = MERGE) -> Any:
        return self.ok("PATCH", path, body, content_type=content_type)

    def names(self, path: str, **params: Any) -> list[str]:
        return [item["metadata"]["name"] for item in self.get(path, **params)["items"]]

    def watch(self, path: str, *, accept: str = "application/json", **params: Any) -> Any:
        query = urllib.parse.urlencode({"watch": "true", **params})
        request = urllib.request.Request(f"{self.url}{path}?{query}", headers={"Accept": accept, **self.headers})
        return urllib.request.urlopen(request, timeout=5, context=self.context)
