"""Reading OpenAI-shaped answers in tests that check tokens: the first choice of a completion (with the
answer's id), or an error's message. The shape itself is checked by tests/runtime/test_openai.py with the
official client."""

from __future__ import annotations

from typing import Any


def flat(body: Any) -> Any:
    if isinstance(body, dict) and isinstance(body.get("choices"), list) and body["choices"]:
        return {**body["choices"][0], "id": body.get("id")}
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return {**body["error"], "error": body["error"].get("message", "")}
    return body


def greedy(body: dict[str, Any]) -> dict[str, Any]:
    """A request body asking for greedy decoding (OpenAI's default temperature is 1) unless it says otherwise."""
    return {"temperature": 0, **body}
