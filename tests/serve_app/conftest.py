"""A real HTTP server (uvicorn on a free localhost port, in a background thread) around the app.

The serving stack (uvicorn, FastAPI) is imported where a fixture needs it, so a GPU host without it can
still run this folder's transport tests (test_serve_cuda_ipc.py)."""

from __future__ import annotations

import socket
import threading
import time

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.serve_app.stub_backend import ScriptedBackend

MODEL = "gpt-oss-test"
MAX_CONTEXT = 4096
START_DATE = "2025-06-28"


class LiveServer:
    def __init__(self, app):
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


def scripted_app(backend: "ScriptedBackend", **options) -> LiveServer:
    """A LiveServer (to enter) of the app around `backend`: the test model's name, the pinned date and the
    backend's context, then `options` (create_app's keywords, which may override those)."""
    from serve_app.openai_api.app import create_app

    return LiveServer(create_app(backend, **{"model_name": MODEL, "max_context": backend.max_context,
                                             "conversation_start_date": START_DATE, **options}))


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="session")
def backend_and_server():
    from serve_app.openai_api.app import create_app
    from tests.serve_app.stub_backend import ScriptedBackend

    backend = ScriptedBackend(max_context=MAX_CONTEXT)
    app = create_app(backend, model_name=MODEL, max_context=MAX_CONTEXT, conversation_start_date=START_DATE,
                     max_body_bytes=256 * 1024)
    with LiveServer(app) as server:
        yield backend, server


@pytest.fixture
def backend(backend_and_server) -> ScriptedBackend:
    stub, _ = backend_and_server
    stub.reset()
    return stub


@pytest.fixture
def server(backend_and_server) -> LiveServer:
    return backend_and_server[1]


@pytest.fixture
def client(server, backend):
    return openai_client(server.url)
