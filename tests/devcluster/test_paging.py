"""Paged lists on the local API server: `limit` and `continue` through kubectl's chunks and raw HTTP, pages that
show the list as it was at its first page, and the answers to tokens that are too old or not tokens at all."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from tests.devcluster.apiclient import Client

CMS = "/api/v1/namespaces/default/configmaps"
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"

Kubectl = Callable[..., str]


def create(api: Client, *names: str) -> None:
    for name in names:
        api.create(CMS, {"metadata": {"name": name}, "data": {"a": "1"}})


def pages(api: Client, limit: int, **params: Any) -> list[dict[str, Any]]:
    """Every page of the config map list, following `continue`."""
    found = [api.get(CMS, limit=limit, **params)]
    while found[-1]["metadata"].get("continue"):
        found.append(api.get(CMS, limit=limit, **{**params, "continue": found[-1]["metadata"]["continue"]}))
    return found


def names(page: dict[str, Any]) -> list[str]:
    return [item["metadata"]["name"] for item in page["items"]]


def test_kubectl_get_with_a_chunk_size_lists_every_object_across_pages(
        api: Client, kubectl: Kubectl, tmp_path: Path) -> None:
    create(api, *(f"cm-{i}" for i in range(7)))
    assert kubectl("get", "configmaps", "--chunk-size=2", "-o", "name").splitlines() == [
        f"configmap/cm-{i}" for i in range(7)]
    printed = kubectl("get", "configmaps", "--chunk-size=2")
    assert [line.split()[0] for line in printed.splitlines()] == ["NAME", *(f"cm-{i}" for i in range(7))]
    requests = subprocess.run(["kubectl", "--kubeconfig", str(tmp_path / "kubeconfig"), "get", "configmaps",
                               "--chunk-size=2", "-v=6"], capture_output=True, text=True, timeout=30).stderr
    assert requests.count("continue=") == 3  # four pages of 2, 2, 2 and 1


def test_pages_of_a_list_carry_its_resource_version_continue_and_the_count_left(api: Client) -> None:
    create(api, "a", "b", "c", "d", "e")
    found = pages(api, 2)
    assert [names(page) for page in found] == [["a", "b"], ["c", "d"], ["e"]]
    assert len({page["metadata"]["resourceVersion"] for page in found}) == 1
    assert [page["metadata"].get("remainingItemCount") for page in found] == [3, 1, None]


def test_a_selective_list_pages_through_the_selected_objects_without_a_remaining_count(api: Client) -> None:
    create(api, "a", "b", "c", "d")
    found = pages(api, 1, fieldSelector="metadata.name!=b")
    assert [names(page) for page in found] == [["a"], ["c"], ["d"]]
    assert all("remainingItemCount" not in page["metadata"] for page in found)


def test_later_pages_show_the_list_as_it_was_at_the_first_page(api: Client) -> None:
    create(api, "a", "b", "c", "d")
    first = api.get(CMS, limit=2)
    create(api, "bb", "e")
    api.ok("DELETE", f"{CMS}/c")
    api.patch(f"{CMS}/d", {"data": {"a": "2"}})
    rest = api.get(CMS, limit=10, **{"continue": first["metadata"]["continue"]})
    assert names(rest) == ["c", "d"]
    assert rest["items"][1]["data"] == {"a": "1"}
    assert names(api.get(CMS)) == ["a", "b", "bb", "d", "e"]


def test_a_continue_token_older_than_the_retained_history_is_gone(start: Callable[..., Client]) -> None:
    api = start(history_limit=3)
    create(api, "a", "b", "c")
    token = api.get(CMS, limit=1)["metadata"]["continue"]
    create(api, "d", "e", "f", "g")
    status, answer = api.call("GET", CMS, limit=1, **{"continue": token})
    assert (status, answer["reason"]) == (410, "Expired")
    assert "too old to display a consistent list result" in answer["message"]


@pytest.mark.parametrize(("params", "message"), [
    ({"limit": "2", "continue": "not-a-token"}, "continue key is not valid"),
    ({"limit": "-1"}, "limit: Invalid value"),
    ({"limit": "two"}, "limit: Invalid value"),
    ({"limit": "2", "continue": "eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MSwic3RhcnQiOlsiIiwiYSJdfQ",
      "resourceVersion": "1"}, "specifying resource version is not allowed when using continue"),
])
def test_a_malformed_page_request_is_a_bad_request_that_says_why(api: Client, params: dict[str, str],
                                                                 message: str) -> None:
    status, answer = api.call("GET", CMS, **params)
    assert status == 400
    assert message in answer["message"]


def test_a_table_pages_like_a_list(api: Client) -> None:
    create(api, "a", "b", "c")
    first = api.ok("GET", CMS, accept=TABLE, limit=2)
    assert [row["cells"][0] for row in first["rows"]] == ["a", "b"]
    rest = api.ok("GET", CMS, accept=TABLE, limit=2, **{"continue": first["metadata"]["continue"]})
    assert [row["cells"][0] for row in rest["rows"]] == ["c"]

