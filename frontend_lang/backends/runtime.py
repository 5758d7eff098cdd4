"""`RuntimeEndpoint`: programs on a radixserve server over HTTP (`POST /generate`).

The server tokenizes: every call sends the program's text, so what a program generates is
exactly what the same text gives through /generate. Role blocks need the model's chat
template on this side; unless one is passed, it comes from the tokenizer in the server's model
folder (`GET /server_info` -> `model.path`), loaded with transformers, which works when the
program runs on the server's machine (as with `make serve`). Elsewhere, pass
`chat_template=`: a `ChatTemplate`, a tokenizer, or a local copy of the model folder.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from frontend_lang.backends.base import Backend, BackendError
from frontend_lang.chat_template import ChatTemplate


class RuntimeEndpoint(Backend):
    """A radixserve server at `url`; `api_key` is sent as `Authorization: Bearer <key>`.

    `timeout` bounds each call (seconds); one httpx client (a connection pool) is shared by
    every thread of a program or a `run_batch`.
    """

    def __init__(
        self, url: str, api_key: str | None = None, *, chat_template: Any = None,
        timeout: float = 600.0, max_connections: int = 256,
    ) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._httpx = httpx
        self._client = httpx.Client(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
        )
        self._template_source = chat_template
        self._template: ChatTemplate | None = chat_template if isinstance(chat_template, ChatTemplate) else None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ calls

    def generate(self, request: dict[str, Any]) -> Any:
        response = self._request("POST", "/generate", json=request)
        return response.json()

    def generate_stream(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        body = {**request, "stream": True}
        try:
            with self._client.stream("POST", "/generate", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error_of(response)
                for line in response.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if isinstance(event, dict) and "error" in event:
                        raise BackendError(_message(event), None)
                    yield event
        except self._httpx.HTTPError as exc:
            raise BackendError(f"the call to {self.url}/generate failed: {exc!r}") from exc

    def server_info(self) -> dict[str, Any]:
        return self._request("GET", "/server_info").json()

    def flush_cache(self) -> bool:
        """Drop every unlocked cached prefix on the server (for measurements)."""
        response = self._client.post("/flush_cache")
        return response.status_code == 200

    def pin(self, text: str, *, tier: str = "memory", ttl: float | None = None,
            cache_salt: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"text": text, "tier": tier}
        if ttl is not None:
            body["ttl"] = ttl
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return self._request("POST", "/cache/pin", json=body).json()

    def unpin(self, pin_id: int) -> list[dict[str, Any]]:
        return self._request("POST", "/cache/unpin", json={"pin_id": pin_id}).json()["unpinned"]

    def close(self) -> None:
        self._client.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, path, **kwargs)
        except self._httpx.HTTPError as exc:
            raise BackendError(f"the call to {self.url}{path} failed: {exc!r}") from exc
        if response.status_code >= 400:
            raise _error_of(response)
        return response

    # ------------------------------------------------------------------ chat template

    @property
    def chat_template(self) -> ChatTemplate:
        with self._lock:
            if self._template is None:
                self._template = self._load_template()
            return self._template

    def _load_template(self) -> ChatTemplate:
        source = self._template_source
        if source is None:
            source = self._server_model_path()
        if isinstance(source, (str, Path)):
            source = _local_tokenizer(Path(source))
        return ChatTemplate.from_tokenizer(source)

    def _server_model_path(self) -> str:
        for path, pick in (("/server_info", _path_in_server_info), ("/get_model_info", _path_in_model_info)):
            try:
                found = pick(self._request("GET", path).json())
            except BackendError as exc:
                if exc.status == 404:  # an older or newer server: try the other route
                    continue
                raise
            if found:
                return found
        raise ValueError(
            f"role blocks need the model's chat template, and {self.url} does not say where its "
            "model is; pass RuntimeEndpoint(url, chat_template=...)"
        )


def _path_in_server_info(info: dict[str, Any]) -> str | None:
    model = info.get("model")
    return model.get("path") if isinstance(model, dict) else None


def _path_in_model_info(info: dict[str, Any]) -> str | None:
    return info.get("model_path")


def _local_tokenizer(path: Path) -> Any:
    if not path.is_dir():
        raise ValueError(
            f"role blocks need the model's chat template: the server's model folder {str(path)!r} "
            "is not on this machine; pass RuntimeEndpoint(url, chat_template=...) (a ChatTemplate, "
            "a tokenizer, or a local copy of the model folder)"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)


def _message(body: Any) -> str:
    """The server's error message out of an OpenAI-shaped (or any JSON) error body."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return json.dumps(body)


def _error_of(response: Any) -> BackendError:
    try:
        message = _message(response.json())
    except ValueError:
        message = response.text.strip() or response.reason_phrase
    return BackendError(message, response.status_code)
